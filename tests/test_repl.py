"""The interactive chat, driven as a person would: `exokv chat` in a pseudo-terminal.

The pty tests start the real command with a real terminal (the child's controlling
tty, so Ctrl-C is a SIGINT from the line discipline, as in a shell), type into it and
read what it draws. The in-process tests drive `run_repl` with prompt-toolkit's pipe
input and a fake client, for the keys and the rendering details.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from chat_helpers import ANSI, Terminal, home_with_models
from prompt_toolkit.application import create_app_session
from prompt_toolkit.input import create_pipe_input
from prompt_toolkit.output import DummyOutput
from rich.console import Console

from exokv.chat.conversation import ChatController, TurnSettings
from exokv.chat.render import Renderer, status_line, visible
from exokv.chat.repl import ChatCompleter, run_repl
from exokv.core.records import TurnRequest, TurnResult
from tests.stub_client import StubClient

pytestmark = pytest.mark.timeout(120)

STATUS = re.compile(
    r"([\d,]+) prompt · ([\d,]+) cached \((\d+)%\) · ([\d,]+) prefilled · ([\d,]+) generated"
    r"[^\n]*"
)


def _num(text: str) -> int:
    return int(text.replace(",", ""))


# -- a shared builtin:tiny, and homes that use it ------------------------------------------


@pytest.fixture(scope="session")
def models(models_dir: Path) -> Path:
    return models_dir


def exokv_env(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("EXOKV_DEBUG", "NO_COLOR")}
    return {**env, "EXOKV_HOME": str(home), **extra}


def script_chat(home: Path, lines: list[str], *args: str) -> list[dict[str, Any]]:
    proc = subprocess.run(
        [sys.executable, "-m", "exokv", "chat", "--model", "builtin:tiny", "--json", *args],
        input="\n".join(lines).encode() + b"\n",
        capture_output=True,
        env=exokv_env(home),
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr.decode()
    return [json.loads(x) for x in proc.stdout.decode().splitlines() if x.strip()]


# -- a terminal ----------------------------------------------------------------------------


def chat_terminal(home: Path, *args: str) -> Terminal:
    # --plain: these tests read the replies' raw text off the screen (test_markdown.py
    # reads the rendered markdown).
    cmd = [sys.executable, "-m", "exokv", "chat", "--model", "builtin:tiny", "--plain", *args]
    return Terminal(cmd, exokv_env(home))


def prompt(session: str) -> str:
    return re.escape(session) + r" › "


def say(term: Terminal, session: str, line: str) -> tuple[str, re.Match[str]]:
    """Type a line at the prompt; returns what was streamed as the reply and the status."""
    start = term.pos
    term.type(line + "\r")
    status = term.expect(STATUS.pattern)
    # prompt-toolkit redraws the line as it is typed; the reply follows the last drawing.
    echo = prompt(session) + re.escape(line) + "\n"
    drawn = list(re.finditer(echo, term.text[start : status.start()]))
    assert drawn, f"the line {line!r} was not echoed"
    reply = term.text[start + drawn[-1].end() : status.start()]
    term.expect(prompt(session))
    return reply.rstrip("\n"), status


def _db_messages(home: Path, session: str) -> list[dict[str, str]]:
    from exokv.state import Store

    with Store.open(home) as store:
        return store.load_messages(session)


# -- the Must-show REPL test ----------------------------------------------------------------


@pytest.mark.slow
def test_repl_turns_retry_switch_and_resume(tmp_path: Path, models: Path) -> None:
    home = home_with_models(tmp_path / "home", models, link=True)
    lines = ["Hello, who are you?", "Tell me about the sea."]
    term = chat_terminal(home, "--max-tokens", "12", "--session", "s1")
    try:
        term.expect(r"exokv · builtin:tiny · 1 rank · cache budget")
        term.expect(r"Esc\+Enter")
        term.expect(prompt("s1"))
        reply1, st1 = say(term, "s1", lines[0])
        reply2, st2 = say(term, "s1", lines[1])
        retried, st3 = say(term, "s1", "/retry")
        term.type("/new s2\r")
        term.expect(r"new session 's2'")
        term.expect(prompt("s2"))
        other, st4 = say(term, "s2", "What is two plus two?")
        term.type("/sw")  # Tab completes the command with its space: "/switch "
        time.sleep(0.3)
        term.type("\t")
        time.sleep(0.3)
        term.type("s1\r")
        term.expect(r"switched to 's1' \(2 turns\)")
        term.expect(prompt("s1"))
        back, st5 = say(term, "s1", "And the rivers?")
        term.type("/sessions\r")
        term.expect(r"\* s1 +\d+ +[\d,]+ ")
        term.expect(prompt("s1"))
        term.type("\x04")  # Ctrl-D: quit, saving s1's KV cache
        term.expect(r"saved the KV cache of 's1'")
    finally:
        code = term.close()
    assert code == 0, term.text[-2000:]

    prompt_tokens = [_num(s.group(1)) for s in (st1, st2, st3, st4, st5)]
    cached = [_num(s.group(2)) for s in (st1, st2, st3, st4, st5)]
    assert cached[0] == 0
    assert cached[1] >= prompt_tokens[0]  # turn 2 reuses turn 1's prompt and reply
    assert cached[2] == prompt_tokens[2] - 1  # /retry: all but the last token is cached
    assert cached[4] >= prompt_tokens[2]  # back in s1 after /switch: served from the cache
    for status in (st1, st2, st3, st4, st5):
        assert _num(status.group(4)) == _num(status.group(1)) - _num(status.group(2))

    # The streamed replies are the conversation's replies, and the same as --no-cache.
    script = [*lines, "/retry", "/new s2", "What is two plus two?", "/switch s1"]
    script.append("And the rivers?")
    cold_home = home_with_models(tmp_path / "cold", models, link=True)
    cold = [d for d in script_chat(cold_home, script, "--session", "s1", "--max-tokens", "12",
                                   "--no-cache") if "turn" in d]  # fmt: skip
    streamed = [reply1, reply2, retried, other, back]
    assert streamed == [visible(d["reply"]) for d in cold]
    assert retried == reply2
    stored = _db_messages(home, "s1")
    assert [m["content"] for m in stored] == [lines[0], cold[0]["reply"], lines[1]] + [
        cold[2]["reply"],
        "And the rivers?",
        cold[4]["reply"],
    ]

    # A new process resumes s1: its history, and its KV cache.
    term = chat_terminal(home, "--max-tokens", "12", "--session", "s1")
    try:
        term.expect(r"resumed 's1': 3 turns")
        loaded = term.expect(r"its KV cache: ([\d,]+) tokens on disk")
        term.expect(prompt("s1"))
        _, st6 = say(term, "s1", "One more thing.")
        term.type("/quit\r")
    finally:
        code = term.close()
    assert code == 0, term.text[-2000:]
    assert _num(loaded.group(1)) >= prompt_tokens[4]
    assert _num(st6.group(2)) == _num(loaded.group(1))  # the first turn prefills only new text


@pytest.mark.slow
def test_ctrl_c_stops_a_long_reply(tmp_path: Path, models: Path) -> None:
    home = home_with_models(tmp_path / "home", models, link=True)
    max_tokens = "250"
    term = chat_terminal(home, "--max-tokens", max_tokens, "--session", "c")
    try:
        term.expect(prompt("c"))
        term.type("Hello, who are you?\r")
        term.expect(prompt("c") + r"Hello, who are you\?\s*\n")
        term.expect(r"\S{20}")  # the reply is streaming
        pressed = time.monotonic()
        term.type("\x03")
        status = term.expect(STATUS.pattern + r"interrupted")
        term.expect(prompt("c"))
        back_in = time.monotonic() - pressed
        generated = _num(status.group(5))
        _, status2 = say(term, "c", "Tell me about the sea.")
        term.type("\x04")
    finally:
        code = term.close()
    assert code == 0, term.text[-2000:]
    assert back_in < 1.0, f"Ctrl-C took {back_in:.2f} s to return to the prompt"
    assert 0 < generated < int(max_tokens)
    # The partial reply is kept, and the next turn is what --no-cache gives for it.
    messages = _db_messages(home, "c")
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant"]
    assert messages[1]["content"]
    assert _num(status2.group(2)) > 0
    cold = cold_reply(home, messages[:3], int(max_tokens))
    assert messages[3]["content"] == cold


def cold_reply(home: Path, messages: list[dict[str, str]], max_tokens: int) -> str:
    """What --no-cache replies to `messages` in a fresh process resuming a copy of the chat.

    The copy keeps the replies' exact tokens (stored with the messages in exokv.db;
    `set_messages` without tokens keeps them), so the prompt is rendered exactly as in
    the original process.
    """
    from exokv.state import Store

    fresh = home.parent / "cold-home"
    shutil.copytree(home, fresh, symlinks=True)
    with Store.open(fresh) as store:
        store.set_messages("c", messages[:-1])
    turns = script_chat(
        fresh, [messages[-1]["content"]], "--session", "c", "--no-cache",
        "--max-tokens", str(max_tokens),
    )  # fmt: skip
    return turns[-1]["reply"]


# -- in process: keys, completion, rendering ------------------------------------------------


class FakeClient(StubClient):
    """Replies 'echo: <last user line>' in pieces, with plausible numbers."""

    ranks = 1
    budgets = [64_000_000]

    def __init__(self) -> None:
        self.requests: list[TurnRequest] = []

    def turn(self, request: TurnRequest, on_text=None, on_progress=None) -> TurnResult:
        self.requests.append(request)
        text = "echo: " + request.messages[-1]["content"]
        if on_progress:
            on_progress(10, 40)
            on_progress(39, 40)
        for i in range(0, len(text), 4):
            if on_text:
                on_text(text[i : i + 4])
        return TurnResult(
            session=request.session,
            reply=text,
            prompt_tokens=40,
            cached_tokens=10,
            prefilled_tokens=30,
            generated_tokens=5,
            ttft_s=0.01,
            decode_tps=100.0,
            overhead_s=0.0,
            ranks=1,
        )


class Opts:
    model = "fake"
    parallel = "pipeline"
    split = None
    no_cache = False


def drive(keys: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[FakeClient, str]:
    monkeypatch.setenv("EXOKV_HOME", str(tmp_path))
    client = FakeClient()
    chat = ChatController(client, TurnSettings(), "main")
    out = io.StringIO()
    renderer = Renderer(Console(file=out, width=120), Console(file=out, width=120))
    with create_pipe_input() as pipe, create_app_session(input=pipe, output=DummyOutput()):
        pipe.send_text(keys)
        code = run_repl(chat, client, Opts(), input=pipe, output=DummyOutput(), renderer=renderer)
    assert code == 0
    return client, out.getvalue()


def test_multiline_keys_and_ctrl_d(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    keys = "first line\x1b\rsecond line\r" + "third \\\rfourth\r" + "\x04"
    client, out = drive(keys, tmp_path, monkeypatch)
    users = [r.messages[-1]["content"] for r in client.requests]
    assert users == ["first line\nsecond line", "third \nfourth"]
    assert "echo: first line\nsecond line" in out
    assert "\x1b[" not in out  # not a terminal: no colours, no cursor movement
    assert "40 prompt · 10 cached (25%) · 30 prefilled" in out


def test_ctrl_c_at_the_prompt_clears_the_line(tmp_path, monkeypatch) -> None:
    client, out = drive("half a thought\x03/quit\r", tmp_path, monkeypatch)
    assert client.requests == []
    assert "Ctrl-D or /quit leaves" in out


def test_history_is_kept_in_exokv_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from exokv.chat.repl import _history

    monkeypatch.setenv("EXOKV_HOME", str(tmp_path))
    history = _history()
    history.append_string("remember me")
    assert "remember me" in (tmp_path / "history").read_text()
    assert list(_history().load_history_strings()) == ["remember me"]


def test_completion_of_commands_and_sessions() -> None:
    from prompt_toolkit.document import Document

    client = FakeClient()
    chat = ChatController(client, TurnSettings(), "main")
    chat.command("/new alpha")
    chat.command("/new beta")

    def complete(text: str) -> list[str]:
        return [c.text for c in ChatCompleter(chat).get_completions(Document(text), None)]

    assert complete("/s") == ["/switch ", "/sessions ", "/system ", "/set ", "/stats", "/save"]
    assert complete("/switch ") == ["alpha", "main"]  # not the current one (beta)
    assert complete("/switch al") == ["alpha"]
    assert complete("/pin ") == ["alpha", "beta", "main"]  # the current one too
    assert complete("/unpin m") == ["main"]
    assert complete("hello /s") == []


def test_progress_bar_shows_the_cached_part(monkeypatch: pytest.MonkeyPatch) -> None:
    import exokv.chat.render as render

    monkeypatch.setattr(render, "BAR_MIN_TOKENS", 10)
    out = io.StringIO()
    r = Renderer(Console(file=out, force_terminal=True, width=120, color_system="truecolor"))
    r.begin_turn()
    r.on_progress(1000, 3000)
    r.on_progress(1512, 3000)
    assert r._progress is not None
    r._progress.refresh()
    r.on_text("hi")
    assert r._progress is None  # the bar goes when the first token comes
    r.end_turn()
    text = ANSI.sub("", out.getvalue())
    assert "1,512/3,000 tokens" in text and "(1,000 cached)" in text
    # cached part first (cyan), then the prefilled part (green)
    assert "\x1b[36m━" in out.getvalue() and "\x1b[32m━" in out.getvalue()


def test_no_color_is_respected(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NO_COLOR", "1")
    out, err = io.StringIO(), io.StringIO()
    r = Renderer(
        Console(file=out, force_terminal=True, width=120),
        Console(file=err, force_terminal=True, width=120),
    )
    r.warning("careful")
    r.message("oops", error=True)
    r.status(TurnResult("s", "x", 10, 5, 5, 1, 0.1, 1.0, 0.0, 1))
    assert "exokv: warning: careful" in err.getvalue() and "oops" in err.getvalue()
    for text in (out.getvalue(), err.getvalue()):
        assert not re.search(r"\x1b\[[0-9;]*(3[0-9]|9[0-7])m", text), "a colour despite NO_COLOR"


def test_status_line_and_control_characters() -> None:
    result = TurnResult("s", "x", 200, 150, 50, 7, 0.25, 42.0, 0.0, 1, finish_reason="stop")
    result.events = []
    line = status_line(result)
    assert line.startswith("200 prompt · 150 cached (75%) · 50 prefilled · 7 generated")
    assert "TTFT 250 ms" in line and "42.0 tok/s" in line
    assert visible("a\x1b[2Jb\nc\td") == "a\ufffd[2Jb\nc\td"


# -- the chat as people use it: resume, Ctrl-C, typed-ahead keys, redirected output ---------


@pytest.mark.slow
def test_resume_without_model_keeps_the_sessions_model(tmp_path: Path, models: Path) -> None:
    home = home_with_models(tmp_path / "home", models, link=True)
    made = subprocess.run(
        [sys.executable, "-m", "exokv", "chat", "--model", "builtin:tiny", "--session", "pasta",
         "--max-tokens", "6", "Hello, who are you?"],
        capture_output=True, env=exokv_env(home), timeout=120,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr.decode()
    env = exokv_env(home)
    env.pop("EXOKV_MODEL", None)
    term = Terminal([sys.executable, "-m", "exokv", "chat", "--session", "pasta",
                     "--max-tokens", "6"], env)  # fmt: skip
    try:
        term.expect(r"resuming 'pasta' on builtin:tiny")
        term.expect(r"exokv · builtin:tiny · 1 rank")
        term.expect(r"resumed 'pasta': 1 turn\b")
        term.expect(r"its KV cache: [\d,]+ tokens on disk")
        _, status = say(term, "pasta", "And then?")
        term.type("/quit\r")
        term.expect(r"saved the KV cache of 'pasta'")
        term.expect(r"bye")
    finally:
        code = term.close()
    assert code == 0, term.text[-2000:]
    assert "smollm2" not in term.text
    assert _num(status.group(2)) > 0  # the saved KV cache of the same model served the turn


@pytest.mark.slow
def test_repeated_ctrl_c_stops_the_reply_and_never_exits(tmp_path: Path, models: Path) -> None:
    home = home_with_models(tmp_path / "home", models, link=True)
    term = chat_terminal(home, "--max-tokens", "2000", "--session", "c")
    try:
        term.expect(prompt("c"))
        term.type("Tell me a long story.\r")
        term.expect(prompt("c") + r"Tell me a long story\.\s*\n")
        start = term.pos
        term.expect(r"\S{20}")  # the reply is streaming
        term.type("typed ahead")  # not echoed into the reply...
        for _ in range(4):  # impatient: four quick Ctrl-C
            term.type("\x03")
            time.sleep(0.05)
        status = term.expect(STATUS.pattern + r"interrupted")
        reply = term.text[start : status.start()]
        term.expect(prompt("c"))
        time.sleep(1.0)
        assert term.proc.poll() is None, "Ctrl-C left exokv"
        term.type("\x15")  # Ctrl-U: whatever reached the prompt goes
        _, status2 = say(term, "c", "Go on.")
        term.type("\x04")
        term.expect(r"saved the KV cache of 'c'")
        term.expect(r"bye")
    finally:
        code = term.close()
    assert code == 0, term.text[-2000:]
    assert "typed ahead" not in reply and "^C" not in reply
    assert "RuntimeWarning" not in term.text and "Traceback" not in term.text
    assert _num(status2.group(2)) > 0
    assert [m["role"] for m in _db_messages(home, "c")] == ["user", "assistant"] * 2


@pytest.mark.slow
def test_sigterm_while_a_reply_streams_ends_the_repl(tmp_path: Path, models: Path) -> None:
    """The REPL shows a failed turn's error and goes on; a SIGTERM is not such an error:
    it ends the chat (one line, exit 143) with the KV cache kept on disk."""
    home = home_with_models(tmp_path / "home", models, link=True)
    term = chat_terminal(home, "--max-tokens", "2000", "--session", "t")
    try:
        term.expect(prompt("t"))
        term.type("Tell me a long story.\r")
        term.expect(prompt("t") + r"Tell me a long story\.\s*\n")
        term.expect(r"\S{20}")  # the reply is streaming
        term.proc.send_signal(signal.SIGTERM)
        term.expect(r"exokv: terminated by SIGTERM; the conversation and its KV cache are kept")
    finally:
        code = term.close()
    assert code == 128 + signal.SIGTERM, term.text[-2000:]
    assert "Traceback" not in term.text
    assert list(home.glob("kv/*/*/rank0/tree.json"))


@pytest.mark.slow
def test_redirected_stdout_gets_a_transcript(tmp_path: Path, models: Path) -> None:
    home = home_with_models(tmp_path / "home", models, link=True)
    log = tmp_path / "log.txt"
    with log.open("w") as out:
        term = Terminal([sys.executable, "-m", "exokv", "chat", "--model", "builtin:tiny",
                         "--session", "r", "--max-tokens", "6"], exokv_env(home),
                        stdout=out)  # fmt: skip
        try:
            term.expect(prompt("r"))
            term.type("Hello there\r")
            status = term.expect(STATUS.pattern)  # the status line stays on the terminal
            term.expect(prompt("r"))
            term.type("/quit\r")
            term.expect("bye")
        finally:
            code = term.close()
    assert code == 0, term.text[-2000:]
    assert status
    reply = _db_messages(home, "r")[1]["content"]
    assert log.read_text() == f"user: Hello there\nassistant: {reply}\n\n"


def test_slash_commands_people_expect(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    client = FakeClient()
    chat = ChatController(client, TurnSettings(), "main")
    sent = chat.handle("//etc/hosts is a file")
    assert sent is not None and sent.result is not None
    assert client.requests[-1].messages[-1]["content"] == "/etc/hosts is a file"

    assert chat.command("/system").message == "system prompt: (none)"
    chat.command("/system Be brief.")
    assert chat.command("/system").message == "system prompt: Be brief."
    assert chat.current.system == "Be brief."
    assert chat.command("/system clear").message == "system prompt cleared"
    assert chat.current.system is None

    assert chat.command("/set temp 0.7").message == "temp 0.7"
    assert chat.command("/set max-tokens 32").message == "max-tokens 32"
    assert chat.command("/set temp hot").error
    chat.handle("again")
    assert (client.requests[-1].temp, client.requests[-1].max_tokens) == (0.7, 32)
    chat.command("/set temp 0")

    retried = chat.command("/retry")
    assert retried.result is not None and "/retry --temp 0.7" in retried.message
    chat.command("/retry --temp 0.9")
    assert client.requests[-1].temp == 0.9 and chat.settings.temp == 0

    wrong = chat.command("/sesions")
    assert wrong.error and "did you mean /sessions?" in wrong.message
    chat.command("/new other")
    assert chat.command("/switch main").message == "switched to 'main' (2 turns)"
    chat.command("/undo")
    assert chat.command("/switch other").message == "switched to 'other' (0 turns)"
    assert chat.command("/switch main").message == "switched to 'main' (1 turn)"


def test_help_lists_commands_and_keys(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _, out = drive("/help\r\x04", tmp_path, monkeypatch)
    keys = ("/sessions [all]", "/system [TEXT|clear]", "/set temp F", "//text", "Up / Down")
    for text in (*keys, "→", "Ctrl-D"):
        assert text in out, text
    assert out.rstrip().endswith("bye")


def test_status_line_never_says_100_percent_while_it_prefilled() -> None:
    almost = TurnResult("s", "x", 1000, 999, 1, 3, 0.1, 10.0, 0.0, 1)
    assert "999 cached (99%) · 1 prefilled" in status_line(almost)
    whole = TurnResult("s", "x", 1000, 1000, 0, 3, 0.1, 10.0, 0.0, 1)
    assert "1,000 cached (100%) · 0 prefilled" in status_line(whole)


def test_sessions_shows_the_20_most_recent() -> None:
    chat = ChatController(FakeClient(), TurnSettings(), "main")
    for i in range(24):
        chat.command(f"/new s{i}")
    recent = chat.command("/sessions")
    assert len(recent.data) == 20 and recent.message == "5 older sessions: /sessions all"
    assert len(chat.command("/sessions all").data) == 25


@pytest.mark.parametrize(
    ("keys", "line"),
    [
        ("/sw\ts1\r", "/switch s1"),  # one completion: applied at once
        ("/switch \t\r", "/switch s1"),  # one session besides the current
        ("/pin \t\t\t\r\r", "/pin s2"),  # a menu: Tab moves through it, Enter takes it
        ("hello\tthere\r", "hellothere"),  # nothing to complete: Tab adds nothing
    ],
)
def test_tab_in_the_same_burst_as_the_text_completes(keys: str, line: str) -> None:
    """prompt-toolkit's Tab starts its completion in the background and dropped it while
    the one typing started still ran: `/sw` and Tab in one read came back as `/sw`."""
    from types import SimpleNamespace

    from prompt_toolkit.input import create_pipe_input
    from prompt_toolkit.output import DummyOutput

    from exokv.chat.repl import _prompt_session

    chat = SimpleNamespace(known_sessions=lambda: ["s1", "s2"], current=SimpleNamespace(name="s2"))
    with create_pipe_input() as keyboard:
        session = _prompt_session(chat, keyboard, DummyOutput())  # type: ignore[arg-type]
        keyboard.send_text(keys)  # one burst, as a fast typist or a paste sends it
        assert session.prompt("> ") == line
