"""A long prefill's time left (exokv.chat.eta) and script mode's progress line on stderr
(exokv.chat.progress_line), on a fake clock: issue 45, item 7."""

from __future__ import annotations

import io
import json
import random
from types import SimpleNamespace
from typing import Any

import pytest

from exokv.chat import progress_line, script
from exokv.chat.eta import PrefillClock, clock_text
from exokv.chat.progress_line import ERASE, ProgressLine, for_stderr


def _prefill(a: float, b: float, total: int, step: int = 512, noise: float = 0.0):
    """(seconds, tokens done) as a prefill reports them, each token costing a + b*position;
    the first report comes after a start-up second (the trip to the ranks)."""
    rng = random.Random(0)
    now, done = 1.0, 0
    yield now, done
    while done < total:
        end = min(done + step, total)
        cost = a * (end - done) + b * (end * end - done * done) / 2
        now += cost * (1 + rng.uniform(-noise, noise))
        done = end
        yield now, done


def _truth(a: float, b: float, done: int, total: int) -> float:
    return a * (total - done) + b * (total * total - done * done) / 2


@pytest.mark.parametrize(
    ("a", "b", "noise"),
    [
        (2e-4, 6e-8, 0.0),  # builtin:tiny's shape: 5k tokens in ~1.7 s, 25k in ~24 s
        (2e-4, 6e-8, 0.15),  # a loaded machine: each step 15% off either way
        (1e-3, 0.0, 0.1),  # a flat cost per token
    ],
)
def test_time_left_prices_the_rest_of_the_prompt(a: float, b: float, noise: float) -> None:
    total = 25_184
    clock = PrefillClock()
    checked = 0
    for now, done in _prefill(a, b, total, noise=noise):
        clock.report(now, done)
        if done in (7_680, 12_800):  # 30% and half way
            truth = _truth(a, b, done, total)
            left = clock.left(total)
            assert left is not None and abs(left - truth) <= 0.2 * truth, (done, left, truth)
            if b:  # the average rate since the start promises far too little
                average = done / (now - 1.0)
                assert (total - done) / average < 0.7 * truth
            checked += 1
    assert checked == 2
    assert clock.left(total) == 0.0


def test_no_estimate_before_two_steps() -> None:
    clock = PrefillClock()
    assert clock.left(1000) is None
    clock.report(0.0, 0)
    clock.report(1.0, 100)
    assert clock.left(1000) is None  # the first step carries the start: not priced
    clock.report(2.0, 200)
    assert clock.left(1000) is not None


def test_clock_text() -> None:
    assert [clock_text(s) for s in (0.4, 45, 185, 3730)] == ["0:00", "0:45", "3:05", "1:02:10"]


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_line_shows_after_two_seconds_updates_in_place_and_is_erased() -> None:
    err, clock = _Tty(), _Clock()
    line = ProgressLine(err, clock)
    line.start()
    for now, done in _prefill(2e-4, 6e-8, 25_184):
        clock.now = now - 1.0  # the turn starts at 0
        line(done, 25_184)
        if clock.now < progress_line.AFTER_S:
            assert err.getvalue() == ""  # a short prefill shows nothing
    shown = err.getvalue().split(ERASE)[1:]
    assert shown and all("\n" not in s for s in shown)  # one line, rewritten in place
    assert shown[0].startswith("exokv: prefill ") and shown[0].endswith(" left")
    assert "/25,184 tokens · " in shown[0]
    line.clear()
    assert err.getvalue().endswith(ERASE)
    line.clear()  # nothing shown since: nothing written
    assert err.getvalue().endswith(ERASE) and not err.getvalue().endswith(ERASE * 2)


def test_only_a_terminal_gets_the_line() -> None:
    assert for_stderr(io.StringIO()) is None
    assert isinstance(for_stderr(_Tty()), ProgressLine)


class _Chat:
    """A chat whose one turn prefills 3 steps, then streams a reply."""

    def handle(self, line: str, on_text: Any = None, on_progress: Any = None) -> Any:
        assert on_progress is not None  # stderr is a terminal
        for done in (0, 400, 800, 1200):
            on_progress(done, 2000)
        if on_text is not None:
            on_text("Hi.")
        result = SimpleNamespace(
            session="s", prompt_tokens=2000, cached_tokens=0, prefilled_tokens=2000,
            generated_tokens=2, ttft_s=3.0, decode_tps=5.0, reply="Hi.", evictions=0,
            ranks=1, overhead_s=0.0, draft_tokens=0, accepted_tokens=0,
            model_draft_tokens=0, speculation="", speculation_detail={}, finish_reason="stop",
            decision=1,
            rank_stats=[], events=[], replica_bytes=0, replica_s=0.0, replica_error=None,
        )  # fmt: skip
        return SimpleNamespace(result=result, turn=1, command=None, message="", quit=False)


@pytest.mark.parametrize("as_json", [True, False])
def test_script_mode_writes_progress_to_stderr_only(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], as_json: bool
) -> None:
    err = _Tty()
    monkeypatch.setattr(progress_line, "AFTER_S", 0.0)  # every prefill counts as long here
    monkeypatch.setattr(progress_line, "EVERY_S", 0.0)
    monkeypatch.setattr(script.sys, "stderr", err)
    script.run_script(_Chat(), as_json, io.BytesIO(b"a long paste\n"))  # type: ignore[arg-type]
    out = capsys.readouterr().out
    if as_json:
        assert json.loads(out)["reply"] == "Hi."  # one object, nothing else on stdout
    else:
        assert out == "Hi.\n"
    assert "exokv: prefill 1,200/2,000 tokens" in err.getvalue()
    assert err.getvalue().endswith(ERASE)  # erased before the reply (and after the turn)
