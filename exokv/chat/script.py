"""Script mode: each line of standard input is a user turn or a slash command."""

from __future__ import annotations

import json
import sys
from typing import IO, Any

from exokv.chat.conversation import ChatController, Outcome
from exokv.chat.progress_line import ProgressLine, for_stderr

TURN_KEYS = (
    "turn",
    "session",
    "prompt_tokens",
    "cached_tokens",
    "prefilled_tokens",
    "generated_tokens",
    "ttft_s",
    "decode_tps",
    "reply",
    "evictions",
    "ranks",
)


def turn_json(outcome: Outcome) -> dict[str, Any]:
    r = outcome.result
    assert r is not None
    doc = {
        "turn": outcome.turn,
        "session": r.session,
        "prompt_tokens": r.prompt_tokens,
        "cached_tokens": r.cached_tokens,
        "prefilled_tokens": r.prefilled_tokens,
        "generated_tokens": r.generated_tokens,
        "ttft_s": round(r.ttft_s, 6),
        "decode_tps": round(r.decode_tps, 3),
        "reply": r.reply,
        "evictions": r.evictions,
        "ranks": r.ranks,
        "overhead_s": round(r.overhead_s, 6),
        "draft_tokens": r.draft_tokens,
        "accepted_tokens": r.accepted_tokens,
        "model_draft_tokens": r.model_draft_tokens,
        "speculation": r.speculation,
        "speculation_detail": r.speculation_detail,
        "finish_reason": r.finish_reason,
        "decision": r.decision,
        "command": outcome.command,
        "cache_bytes": [s.cache_bytes for s in r.rank_stats],
        "events": [e.to_dict() for e in r.events],
        "rank_stats": [s.to_dict() for s in r.rank_stats],
        "replica_bytes": r.replica_bytes,
        "replica_s": round(r.replica_s, 3),
    }
    if r.replica_error:
        doc["replica_error"] = r.replica_error
    return doc


def outcome_json(outcome: Outcome) -> dict[str, Any]:
    """A turn's object, or `{"command", "ok", "message"|"data"}` for a slash command."""
    if outcome.result is not None:
        return turn_json(outcome)
    doc: dict[str, Any] = {"command": outcome.command, "ok": not outcome.error}
    if outcome.data is None:
        doc["message"] = outcome.message
    else:
        doc["data"] = outcome.data
    return doc


def read_lines(stream: IO[bytes]) -> Any:
    """Lines of stdin as text; bytes that are not UTF-8 become U+FFFD, with a warning."""
    for raw in stream:
        try:
            yield raw.decode("utf-8")
        except UnicodeDecodeError:
            print(
                "exokv: warning: input line is not valid UTF-8; bad bytes replaced", file=sys.stderr
            )
            yield raw.decode("utf-8", errors="replace")


def _renderer() -> Any:
    # deferred: rich (0.02 s) only for replies shown as text, not with --json
    from rich.console import Console

    # deferred: the markdown renderer (0.05 s) likewise
    from exokv.chat.render import Renderer

    return Renderer(Console(file=sys.stdout, highlight=False))


def _leading(first_events: list[dict[str, Any]]) -> Any:
    """outcome_json, with `first_events` (the plan) put before the first turn's events."""
    pending = list(first_events)

    def to_json(outcome: Outcome) -> dict[str, Any]:
        doc = outcome_json(outcome)
        if pending and "events" in doc:
            doc["events"] = [*pending, *doc["events"]]
            pending.clear()
        return doc

    return to_json


def _writer(out: IO[str], progress: ProgressLine | None) -> Any:
    """on_text: the reply straight to `out`, once the progress line is gone."""

    def on_text(text: str) -> None:
        if progress is not None:
            progress.clear()
        out.write(text)
        out.flush()

    return on_text


def _handle(
    chat: ChatController, line: str, on_text: Any, progress: ProgressLine | None
) -> Outcome | None:
    """One line through the chat, a long prefill shown on stderr's progress line."""
    if progress is None:
        return chat.handle(line, on_text=on_text)
    progress.start()
    try:
        return chat.handle(line, on_text=on_text, on_progress=progress)
    finally:
        progress.clear()


def run_one(
    chat: ChatController,
    prompt: str,
    as_json: bool,
    first_events: list[dict[str, Any]] | None = None,
) -> int:
    """`exokv chat PROMPT`: one turn (or one slash command), printed; 1 if it failed."""
    out = sys.stdout
    line = for_stderr(sys.stderr)
    if as_json:
        outcome = _handle(chat, prompt, None, line)
        if outcome is not None:
            out.write(json.dumps(_leading(first_events or [])(outcome)) + "\n")
        return 1 if outcome is not None and outcome.error else 0

    outcome = _handle(chat, prompt, _writer(out, line), line)
    if outcome is None:
        return 0
    if outcome.result is not None:
        out.write("\n")
    elif outcome.data is not None:
        _renderer().outcome(outcome)
    elif outcome.message:
        (sys.stderr if outcome.error else out).write(outcome.message + "\n")
    out.flush()
    return 1 if outcome.error else 0


def run_script(
    chat: ChatController,
    as_json: bool,
    stream: IO[bytes] | None = None,
    first_events: list[dict[str, Any]] | None = None,
) -> int:
    """Each line a turn or a command; with --json one object each, `first_events` (the
    plan) leading the first turn's events."""
    stream = stream or sys.stdin.buffer
    out = sys.stdout
    to_json = _leading(first_events or [])
    progress = for_stderr(sys.stderr)
    on_text = None if as_json else _writer(out, progress)

    for line in read_lines(stream):
        outcome = _handle(chat, line, on_text, progress)
        if outcome is None:
            continue
        if as_json:
            out.write(json.dumps(to_json(outcome)) + "\n")
        elif outcome.result is not None:
            out.write("\n")
            if outcome.message:
                sys.stderr.write(outcome.message + "\n")
        elif outcome.data is not None:
            # The same human tables as the REPL's (--json gives the data).
            out.flush()
            _renderer().outcome(outcome)
        elif outcome.message:
            target = sys.stderr if outcome.error else out
            target.write(outcome.message + "\n")
        out.flush()
        if outcome.quit:
            break
    return 0
