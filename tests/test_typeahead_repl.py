"""The real REPL in a pty types ahead: a pasted draft is prefilled before Enter.

The same paste, a pause, a few more words and Enter, with and without --no-typeahead:
with it on, the turn's prefill after Enter is only what came after the draft's stable
part; `/stats` and `exokv cache stats` say what typing ahead did.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import psutil
import pytest
from chat_helpers import exokv_text, home_with_models
from test_repl import STATUS, _db_messages, _num, chat_terminal, prompt

pytestmark = pytest.mark.slow  # starts ranks, servers or real models: see tests/conftest.py

PASTE = " ".join(f"line {i}: the river carries stones to the sea." for i in range(40))


def _first_turn(home: Path, *flags: str) -> tuple[list[int], str]:
    term = chat_terminal(home, "--max-tokens", "4", "--session", "s", *flags)
    try:
        term.expect(prompt("s"))
        term.type("\x1b[200~" + PASTE + "\x1b[201~")  # a bracketed paste: sent at once
        time.sleep(5.0)  # tiny prefills it in well under a second, on a busy machine too
        term.type(" And the end?\r")
        status = term.expect(STATUS.pattern, timeout=60)
        term.expect(prompt("s"))
        term.type("/stats\r")
        term.expect(r"Evicted")
        start = term.pos
        term.expect(prompt("s"))
        stats = term.text[start : term.pos]
        term.type("/quit\r")
    finally:
        code = term.close()
    assert code == 0, term.text[-2000:]
    numbers = [_num(status.group(i)) for i in (1, 2, 4)]  # prompt, cached, prefilled
    return numbers, stats


@pytest.mark.timeout(180)
def test_a_pasted_draft_is_prefilled_before_enter(tmp_path: Path, models_dir: Path) -> None:
    on_home = home_with_models(tmp_path / "on", models_dir, link=True)
    (prompt_on, cached_on, prefilled_on), said = _first_turn(on_home)
    (prompt_off, cached_off, prefilled_off), _ = _first_turn(
        home_with_models(tmp_path / "off", models_dir, link=True), "--no-typeahead"
    )
    assert prompt_on == prompt_off > 400
    assert cached_off == 0 and prefilled_off == prompt_off
    # Only what was typed after the paste's stable part (and the template's end) is left.
    assert cached_on > prompt_on - 30 and prefilled_on < 30, (prompt_on, cached_on)
    assert "Typed ahead: " in said
    text = exokv_text(on_home, "cache", "stats").stdout
    assert "Typed ahead: " in text and "used by turns" in text


def _rank_process(term_pid: int, rank: int) -> psutil.Process:
    for p in psutil.Process(term_pid).children(recursive=True):
        try:
            if p.environ().get("MLX_RANK") == str(rank):
                return p
        except psutil.Error:
            continue
    raise AssertionError(f"no rank {rank} under the chat")


def _two_rank_turn(home: Path, port: str, kill_rank_1: bool, *flags: str) -> str:
    """A paste, then (kill_rank_1) rank 1 killed once the draft is in its cache, then
    Enter: the REPL's text from the paste on."""
    args = ("-n", "2", "--starting-port", port, "--max-tokens", "6", "--session", "s")
    term = chat_terminal(home, *args, *flags)
    try:
        term.expect(prompt("s"), timeout=90)
        start = term.pos
        term.type("\x1b[200~" + PASTE + "\x1b[201~")
        time.sleep(5.0)  # the draft is prefilled on both ranks
        if kill_rank_1:
            _rank_process(term.proc.pid, 1).send_signal(signal.SIGKILL)
            time.sleep(1.0)
        term.type(" And the end?\r")
        term.expect(STATUS.pattern, timeout=120)
        term.expect(prompt("s"), timeout=60)
        said = term.text[start : term.pos]
        term.type("/quit\r")
    finally:
        code = term.close()
    assert code == 0, term.text[-2000:]
    return said


@pytest.mark.timeout(300)
def test_a_rank_killed_while_a_draft_waits_heals_and_replies_as_without(
    tmp_path: Path, models_dir: Path
) -> None:
    # The draft's entries die with rank 1; the ranks start again, the turn runs on
    # what the new ranks hold, and gives the reply and transcript of a chat with no
    # typing ahead and no failure.
    healed_home = home_with_models(tmp_path / "healed", models_dir, link=True)
    healed = _two_rank_turn(healed_home, "26460", True)
    plain_home = home_with_models(tmp_path / "plain", models_dir, link=True)
    _two_rank_turn(plain_home, "26470", False, "--no-typeahead")
    assert "rank 1 was killed by SIGKILL" in healed, healed[-2000:]
    assert _db_messages(healed_home, "s") == _db_messages(plain_home, "s")
    assert _db_messages(healed_home, "s")[-1]["role"] == "assistant"
