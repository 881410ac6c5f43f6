"""The REPL's numbers are right: the disk bytes /stats shows count /save's copies, the
Tokens column of /sessions follows /undo, the banner and /save say why the disk tier is
off when another chat holds it, a status line breaks at its separators, and /new says
what it keeps."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from chat_helpers import Chat, cache_json, exokv_text, home_with_models, run_exokv
from rich.console import Console
from test_repl import FakeClient, chat_terminal, prompt, say

from exokv.chat.conversation import ChatController, TurnSettings
from exokv.chat.render import Renderer, status_line
from exokv.core.records import TurnResult

pytestmark = pytest.mark.timeout(180)


def _script(home: Path, lines: list[str], *args: str) -> list[dict]:
    proc = run_exokv(
        ["chat", "--model", "builtin:tiny", "--json", "--max-tokens", "6", *args],
        home,
        "\n".join(lines) + "\n",
    )
    assert proc.returncode == 0, proc.stderr.decode()
    return [json.loads(x) for x in proc.stdout.decode().splitlines() if x.strip()]


@pytest.mark.slow
def test_disk_bytes_count_the_copies_save_wrote(tmp_path: Path, models_dir: Path) -> None:
    home = home_with_models(tmp_path / "home", models_dir, link=True)
    docs = _script(home, ["Hello there, tell me a story.", "/save", "/stats"], "--session", "d")
    turn, saved, stats = docs
    assert saved["ok"] and "saved the KV cache of 'd'" in saved["message"]
    # The saved entries stay in RAM and are on disk too: the disk holds their bytes.
    assert stats["data"][0]["disk_bytes"] >= turn["cache_bytes"][0] > 0
    total = cache_json(home, "stats")["total"]
    assert total["disk_bytes"] >= turn["cache_bytes"][0]
    table = exokv_text(home, "cache", "stats").stdout
    assert "Disk" in table and " 0 B" not in table, table


@pytest.mark.slow
def test_sessions_tokens_follow_undo(tmp_path: Path, models_dir: Path) -> None:
    home = home_with_models(tmp_path / "home", models_dir, link=True)
    lines = ["Hello there.", "Tell me about the sea.", "/sessions", "/undo", "/sessions"]
    first, second, before, undone, after = _script(home, lines, "--session", "u")
    assert before["data"][0]["tokens"] == second["prompt_tokens"] + second["generated_tokens"]
    assert "1 turn left" in undone["message"]
    assert after["data"][0]["tokens"] == first["prompt_tokens"] + first["generated_tokens"]
    assert after["data"][0]["turns"] == 1
    last = _script(home, ["/undo", "/sessions"], "--session", "u")[-1]
    assert last["data"][0]["tokens"] == 0  # resumed, then nothing left


def test_new_says_it_keeps_the_system_prompt() -> None:
    chat = ChatController(FakeClient(), TurnSettings(), "main")
    assert chat.command("/new plain").message == "new session 'plain'"
    chat.command("/system Be brief.")
    said = chat.command("/new brief").message
    assert said.startswith("new session 'brief'") and "keeps the system prompt" in said
    assert chat.current.system == "Be brief."


@pytest.mark.parametrize("width", [100, 72, 40, 25])
def test_a_status_line_breaks_at_its_separators(width: int) -> None:
    result = TurnResult("s", "x", 12_345, 12_000, 345, 512, 1.25, 42.0, 0.0, 1)
    result.typed_ahead_tokens, result.finish_reason = 11_000, "length"
    out = io.StringIO()
    r = Renderer(Console(file=out, force_terminal=True, width=width, color_system=None))
    r.status(result)
    lines = out.getvalue().rstrip("\n").split("\n")
    assert len(lines) > 1
    assert all(len(line) <= width for line in lines), lines
    line = status_line(result)
    assert " ".join(lines).split() == line.split()  # never broken in a word
    if width >= max(len(part) for part in line.split(" · ")) + 2:
        # Every part fits: each line is whole parts, broken after a separator.
        assert all(line.endswith(" ·") for line in lines[:-1]), lines


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_banner_and_save_say_who_holds_the_disk_tier(tmp_path: Path, models_dir: Path) -> None:
    home = home_with_models(tmp_path / "home", models_dir, link=True)
    first = Chat(home, "--session", "a")
    try:
        first.send("Hello there.")  # its ranks hold the disk tier
        term = chat_terminal(home, "--max-tokens", "4", "--session", "b")
        try:
            start = term.expect(r"exokv · builtin:tiny · 1 rank · ", timeout=90).start()
            term.expect(prompt("b"))
            head = term.text[start : term.pos].replace("\n", " ")
            say(term, "b", "And you?")
            term.type("/save\r")
            said = term.expect(r"KV cache of 'b' not saved: [^\n]*").group(0)
            term.expect(prompt("b"))
            term.type("/quit\r")
        finally:
            code = term.close()
        assert code == 0, term.text[-2000:]
    finally:
        first.finish()
    assert "disk tier off: " in head and "in use by another exokv chat" in head, head
    assert "disk tier 0" not in head and "--disk-budget 0" not in said, said
    assert "in use by another exokv chat" in said, said
