"""The prefill's spinner and bar (exokv.chat.render), in process with rich on a fake terminal.

Issue 45: on two ranks a short first prompt showed a spinner for 12.6 s, then a bar whose
clock went back from 0:00:12 to 0:00:00, because the bar waited for the first prefill
step's report and kept a clock of its own. The bar shows BAR_AFTER_S after Enter from
the last progress heard, and both count from Enter.
"""

from __future__ import annotations

import io
import re
import time

import pytest
from chat_helpers import ANSI
from rich.console import Console

import exokv.chat.render as render
from exokv.chat.render import Renderer

CLOCK = re.compile(r"prefill[^\n\r]*?(\d+):(\d\d):(\d\d)")


class Unfired:
    def cancel(self) -> None:
        pass


def _terminal() -> tuple[Renderer, io.StringIO]:
    out = io.StringIO()
    return Renderer(Console(file=out, force_terminal=True, width=160)), out


def _clocks(text: str) -> list[int]:
    """Every clock the spinner and the bar showed, in seconds, in order."""
    shown = ANSI.sub("", text)
    return [int(h) * 3600 + int(m) * 60 + int(s) for h, m, s in CLOCK.findall(shown)]


def test_the_clock_goes_on_from_the_spinner_to_the_bar(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    monkeypatch.setattr(render.time, "perf_counter", lambda: now[0])
    # The timers are driven by hand here: they would fire on real time.
    monkeypatch.setattr(render, "_timer", lambda seconds, call: Unfired())
    r, out = _terminal()
    r.begin_turn()  # Enter, at 100.0
    r.on_progress(0, 36)  # a short prompt: no bar yet
    assert r._progress is None
    now[0] = 100.2
    r._start_spinner()
    now[0] = 112.6  # the first step of a slow model on two ranks
    assert r._spinner is not None
    r._spinner.refresh()
    r.on_progress(8, 36)
    assert r._progress is not None and r._spinner is None  # the bar took its place
    r._progress.refresh()
    now[0] = 114.1
    r.on_progress(12, 36)
    r._progress.refresh()
    r.end_turn()
    clocks = _clocks(out.getvalue())
    spun = clocks.index(12)  # the spinner at 12.6 s (it showed 0:00:00 at 0.2 s)
    assert clocks[spun + 1] == 12 and clocks[-1] == 14, clocks  # the bar from there, not 0
    assert clocks == sorted(clocks), clocks  # never back


@pytest.mark.timeout(30)
def test_the_bar_shows_soon_after_enter_from_the_first_report() -> None:
    r, out = _terminal()
    r.begin_turn()
    r.on_progress(0, 36)  # the prefill's start; its first step's report is seconds away
    enter = time.perf_counter()
    while r._progress is None and time.perf_counter() - enter < 5:
        time.sleep(0.01)
    assert r._progress is not None, "no bar without a second report"
    assert time.perf_counter() - enter < render.BAR_AFTER_S + 0.5
    r._progress.refresh()
    r.on_text("Hi")  # the reply replaces it
    assert r._progress is None
    r.end_turn()
    assert "0/36 tokens" in ANSI.sub("", out.getvalue())


@pytest.mark.timeout(30)
def test_no_bar_after_the_reply_began_or_the_turn_ended(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(render, "BAR_AFTER_S", 0.05)
    r, _ = _terminal()
    r.begin_turn()
    r.on_progress(0, 36)
    r.on_text("Hi")  # before the timer: the reply streams, no bar comes over it
    time.sleep(0.2)
    assert r._progress is None
    r.end_turn()
    r.begin_turn()
    r.on_progress(0, 36)
    r.end_turn()  # a command's answer, a refusal: over before the timer
    time.sleep(0.2)
    assert r._progress is None
