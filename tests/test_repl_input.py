"""No keystroke is lost: what is typed or pasted while no prompt is shown reaches the
next prompt, in order, once — the instant a status line appears, while a reply
streams (a paste longer than the terminal's cooked-mode line), while the ranks start
again after a SIGKILL. The real `exokv chat` in a pty, as in test_repl."""

from __future__ import annotations

import itertools
import signal
import time
from pathlib import Path

import pytest
from chat_helpers import home_with_models
from test_repl import STATUS, _db_messages, _num, chat_terminal, prompt
from test_typeahead_repl import _rank_process

pytestmark = pytest.mark.slow  # starts ranks, servers or real models: see tests/conftest.py


def _users(home: Path, session: str) -> list[str]:
    return [m["content"] for m in _db_messages(home, session) if m["role"] == "user"]


@pytest.mark.timeout(400)
def test_a_paste_at_the_status_line_is_the_next_prompt(tmp_path: Path, models_dir: Path) -> None:
    home = home_with_models(tmp_path / "home", models_dir, link=True)
    term = chat_terminal(home, "--max-tokens", "2", "--session", "p")
    pastes = [f"paste {i}: " + " ".join(f"w{i}x{j}" for j in range(30)) for i in range(10)]
    prompts = []
    try:
        term.expect(prompt("p"), timeout=60)
        term.type("hello\r")
        status = term.expect(STATUS.pattern, timeout=60)
        prompts.append(_num(status.group(1)))
        for paste in pastes:
            # The instant the previous turn's status line is on screen: before the
            # next prompt is drawn.
            term.type("\x1b[200~" + paste + "\x1b[201~\r")
            status = term.expect(STATUS.pattern, timeout=60)
            prompts.append(_num(status.group(1)))
        term.expect(prompt("p"))
        term.type("/quit\r")
    finally:
        code = term.close()
    assert code == 0, term.text[-2000:]
    assert _users(home, "p") == ["hello", *pastes]
    # Each paste's tokens are in its turn's prompt (30 words and more, plus the reply).
    assert all(b - a > 30 for a, b in itertools.pairwise(prompts)), prompts
    assert "\x1b[200~" not in term.text and "[200~" not in term.text  # never echoed raw


@pytest.mark.timeout(300)
def test_a_long_paste_during_a_reply_arrives_whole(tmp_path: Path, models_dir: Path) -> None:
    # Longer than a cooked-mode terminal line (4,095 bytes on Linux, 1,024 on macOS),
    # which the line discipline would cut.
    home = home_with_models(tmp_path / "home", models_dir, link=True)
    paste = " ".join(f"s{i}" for i in range(1400))
    assert len(paste) > 5000
    term = chat_terminal(home, "--max-tokens", "200", "--session", "l")
    try:
        term.expect(prompt("l"), timeout=60)
        term.type("Tell me a long story.\r")
        term.expect(prompt("l") + r"Tell me a long story\.\s*\n")
        term.expect(r"\S{10}")  # the reply is streaming
        term.type("\x1b[200~" + paste + "\x1b[201~")
        term.expect(STATUS.pattern, timeout=120)
        term.expect(prompt("l"))
        term.type(" END\r")
        term.expect(STATUS.pattern, timeout=180)
        term.expect(prompt("l"))
        term.type("/quit\r")
    finally:
        code = term.close()
    assert code == 0, term.text[-2000:]
    assert _users(home, "l") == ["Tell me a long story.", paste + " END"]


@pytest.mark.timeout(300)
def test_keys_typed_while_the_ranks_restart_reach_the_prompt(
    tmp_path: Path, models_dir: Path
) -> None:
    home = home_with_models(tmp_path / "home", models_dir, link=True)
    args = ("-n", "2", "--starting-port", "26943", "--max-tokens", "4", "--session", "k")
    term = chat_terminal(home, *args)
    try:
        term.expect(prompt("k"), timeout=90)
        term.type("hello\r")
        term.expect(STATUS.pattern, timeout=60)
        term.expect(prompt("k"))
        _rank_process(term.proc.pid, 1).send_signal(signal.SIGKILL)
        # Said by a thread while the prompt is shown: printed above it, the prompt redrawn.
        term.expect(r"rank 1 was killed by SIGKILL; the ranks start again", timeout=30)
        term.expect(prompt("k"))
        term.type("after the kill\r")
        time.sleep(0.3)  # the ranks are starting again (a 1 s back-off first)
        for word in ("typed ", "while ", "restarting"):
            term.type(word)
            time.sleep(0.2)
        status = term.expect(STATUS.pattern, timeout=120)
        term.expect(r"typed while restarting", timeout=30)  # the next prompt, drawn with it
        term.type(" and after\r")
        term.expect(STATUS.pattern, timeout=60)
        term.expect(prompt("k"))
        term.type("/quit\r")
    finally:
        code = term.close()
    assert code == 0, term.text[-2000:]
    assert status
    assert _users(home, "k") == ["hello", "after the kill", "typed while restarting and after"]
