"""A slow prefill in the real REPL (a pty, builtin:tiny made slow by EXOKV_TEST_SLOW_PREFILL):
Ctrl-C ends it within a step on every rank, typed ahead or not, and keeps nothing of the
exchange; the status line's TTFT counts the wait for the draft step in flight.
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import pytest
from chat_helpers import ANSI, Terminal, home_with_models
from test_repl import STATUS, _num, exokv_env, prompt

pytestmark = pytest.mark.slow  # starts ranks, servers or real models: see tests/conftest.py

SLOW = 0.004  # seconds per prefilled token at the least: 250 tokens/s at the most
STEP_IN_FLIGHT_S = 1.0  # the TTFT test's prefill step: 1 token (pace.FEWEST_TOKENS)
WORDS = "river stone light window garden paper music winter orange signal harbor".split()
PASTE = " ".join(WORDS[(i * 7) % len(WORDS)] for i in range(1000))  # ~2,000+ tokens
SPIN_OR_BAR = re.compile(r"[⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏] prefill[^\n]*|prefill ━[^\n]*")


class TimedTerminal(Terminal):
    """A Terminal that notes when each chunk of output arrived."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.chunks: list[tuple[float, int]] = []

    def read(self, timeout: float) -> bool:
        before = len(self.raw)
        alive = super().read(timeout)
        if len(self.raw) > before:
            self.chunks.append((time.perf_counter(), len(self.raw)))
        return alive

    def first_text_after(self, mark: int) -> float:
        """When the first output after the prompt was left (bracketed paste turned off)
        that is neither the spinner nor the bar arrived: the reply's first characters."""
        left = self.raw.index(b"\x1b[?2004l", mark)
        for at, end in self.chunks:
            if end > left:
                shown = ANSI.sub("", self.raw[left:end].decode("utf-8", "replace"))
                if SPIN_OR_BAR.sub("", shown).strip():
                    return at
        raise AssertionError("no reply on the terminal")


def _chat(home: Path, *args: str, slow: float = SLOW) -> TimedTerminal:
    cmd = [sys.executable, "-m", "exokv", "chat", "--model", "builtin:tiny", *args]
    env = exokv_env(home, EXOKV_TEST_SLOW_PREFILL=str(slow), EXOKV_RANK_LOG="1")
    return TimedTerminal(cmd, env)


def _turn_logs(home: Path, ranks: int) -> list[list[dict]]:
    logs = []
    for r in range(ranks):
        lines = (home / "ranks" / f"rank-{r}.jsonl").read_text().splitlines()
        logs.append([json.loads(line) for line in lines if '"turn"' in line])
    return logs


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "ranks,typeahead,port",
    [(1, True, None), (1, False, None), (2, True, "26940"), (2, False, "26960")],
)
def test_ctrl_c_stops_a_long_prefill_at_once_and_keeps_nothing(
    tmp_path: Path, models_dir: Path, ranks: int, typeahead: bool, port: str | None
) -> None:
    home = home_with_models(tmp_path / "home", models_dir, link=True)
    args = ["--max-tokens", "4", "--session", "s"]
    if ranks > 1:
        args += ["-n", str(ranks), "--starting-port", str(port)]
    if not typeahead:
        args.append("--no-typeahead")
    term = _chat(home, *args)
    try:
        term.expect(prompt("s"), timeout=120)
        term.type("\x1b[200~" + PASTE + "\x1b[201~")
        time.sleep(0.3)
        term.type("\r")
        enter = time.perf_counter()
        time.sleep(1.0)  # well into the prefill, which takes PASTE's tokens x SLOW at least
        term.type("\x03")
        term.expect(r"stopped before the reply began; nothing kept", timeout=60)
        ended = time.perf_counter()
        term.expect(prompt("s"))
        term.type("hi\r")
        after = term.expect(STATUS.pattern, timeout=60)
        term.expect(prompt("s"))
        term.type("/quit\r")
    finally:
        code = term.close()
    assert code == 0, term.text[-2000:]
    # It ended long before its prefill could have: the paste is > 2,000 tokens.
    assert ended - enter < 2000 * SLOW / 2, ended - enter
    # Nothing of the stopped exchange is in the conversation: the next prompt is short.
    assert _num(after.group(1)) < 100, after.group(0)
    assert _num(after.group(5)) > 0
    if ranks == 1:
        return  # the rank logs below are the ranks' (one rank runs in the chat's process)
    logs = _turn_logs(home, ranks)
    stopped, next_turn = logs[0][0], logs[0][1]
    assert 0 < sum(stopped["prefill_steps"]) < 2000 // 2, stopped["prefill_steps"]
    assert len(stopped["prefill_steps"]) >= 2  # steps by time, each with its stop check
    assert next_turn["prefill_steps"]
    for log in logs[1:]:  # every rank took rank 0's steps
        assert [t["prefill_steps"] for t in log] == [t["prefill_steps"] for t in logs[0]]


@pytest.mark.timeout(180)
def test_the_status_ttft_counts_the_draft_step_in_flight(tmp_path: Path, models_dir: Path) -> None:
    home = home_with_models(tmp_path / "home", models_dir, link=True)
    # A model this slow has the smallest steps (pace.FEWEST_TOKENS), each a second long:
    # the wait for the one in flight is far above the delay of a loaded machine's pty.
    # (Every token is a second: the lines are short.)
    term = _chat(home, "--max-tokens", "4", "--session", "s", slow=STEP_IN_FLIGHT_S)
    try:
        term.expect(prompt("s"), timeout=120)
        term.type("hi\r")  # the template's start is cached, and the pace measured
        term.expect(STATUS.pattern, timeout=60)
        term.expect(prompt("s"))
        line = " ".join(WORDS[(i * 3) % len(WORDS)] for i in range(3))
        term.type("\x1b[200~" + line + "\x1b[201~")  # a paste: its draft goes at once
        # One token a step: the first steps run the template's tokens before the line,
        # then its words; Enter 0.4 s into a step once several of those are in.
        time.sleep(6.4)
        mark = len(term.raw)
        term.type(" end?\r")
        enter = time.perf_counter()
        status = term.expect(STATUS.pattern, timeout=60)
        outside = term.first_text_after(mark) - enter
        term.expect(prompt("s"))
        term.type("/quit\r")
    finally:
        code = term.close()
    assert code == 0, term.text[-2000:]
    shown = status.group(0)
    value, unit = re.search(r"TTFT ([\d.]+) (ms|s)", shown).groups()
    ttft = float(value) / (1000 if unit == "ms" else 1)
    assert "typed ahead" in shown, shown  # a draft was prefilled before Enter
    # The status line's TTFT is Enter to first token as seen here, not less: the wait
    # for the draft step in flight is in it. Without it the TTFT would be short by most
    # of a step (Enter came 0.4 s into one); the tolerance is the pty's delay here.
    assert ttft >= outside - 0.25, (ttft, outside)
