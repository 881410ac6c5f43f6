"""The real REPL in a pty types ahead: a pasted draft is prefilled before Enter.

The same paste, a pause, a few more words and Enter, with and without --no-typeahead:
with it on, the turn's prefill after Enter is only what came after the draft's stable
part; `/stats` and `exokv cache stats` say what typing ahead did.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from chat_helpers import exokv_text, home_with_models
from test_repl import STATUS, _num, chat_terminal, prompt

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
