"""Prefill steps sized by time (exokv.rank.pace), in this process on builtin:tiny.

A step ends with the turn's stop check and a progress report, so a prompt that was one
512-token step reports progress several times, a slow prefill's steps are a fraction of
a second whatever the model's speed, and a stop lands within a step. The time to first
token is counted from the request, the draft step in flight included.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from chat_helpers import ANSI

from exokv.chat.conversation import ChatController, TurnSettings
from exokv.client.stopwatch import FirstText
from exokv.core.records import TurnRequest, TurnResult
from exokv.rank import pace as pace_module
from exokv.rank.engine import PREFILL_STEP, Engine
from exokv.rank.pace import FIRST_TOKENS, GROWTH, TARGET_S, Pace

SLOW = "EXOKV_TEST_SLOW_PREFILL"


def _prompt(words: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": " ".join(f"stone{i % 97} river" for i in range(words))}]


@pytest.fixture
def slow(monkeypatch: pytest.MonkeyPatch):
    def set_to(seconds_per_token: float) -> None:
        monkeypatch.setenv(SLOW, str(seconds_per_token))

    return set_to


# -- the pace, alone ---------------------------------------------------------------------


def _steps(pace: Pace, cost: Callable[[int], float], count: int) -> list[int]:
    """The sizes `pace` gives `count` steps in a row when a step of n tokens costs cost(n)."""
    sizes = []
    for _ in range(count):
        sizes.append(pace.tokens())
        pace.took(sizes[-1], cost(sizes[-1]))
    return sizes


def test_the_first_step_is_small_and_the_next_grow_from_the_measured_cost() -> None:
    p = Pace()
    assert p.tokens() == FIRST_TOKENS
    # Very fast: each step GROWTH times the one before, up to the largest step.
    sizes = _steps(p, lambda n: 0.0001 * n, 7)
    assert sizes[:3] == [FIRST_TOKENS, FIRST_TOKENS * GROWTH, FIRST_TOKENS * GROWTH**2]
    assert sizes[-1] == p.tokens() == PREFILL_STEP == pace_module.MOST_TOKENS
    p.took(0, 0.0)  # nothing measured changes nothing
    assert p.tokens() == PREFILL_STEP


def test_steps_hold_what_fits_in_the_target_beside_the_fixed_cost() -> None:
    p = Pace()
    # 10 ms a step and 5 ms a token: a quarter of a second holds 48 tokens.
    assert _steps(p, lambda n: 0.01 + 0.005 * n, 8)[-1] == int((TARGET_S - 0.01) / 0.005)
    # The machine twice as slow: the steps follow, to about what the new cost fits (23).
    slower = _steps(p, lambda n: 0.02 + 0.01 * n, 10)
    assert abs(slower[-1] - (TARGET_S - 0.02) / 0.01) <= 4, slower


def test_a_fixed_cost_above_the_target_is_not_taken_for_a_slow_model() -> None:
    """Tensor-parallel ranks on loaded cores: 0.6 s a step whatever its tokens, 10 ms a
    token. Read as tokens per second every step would stay one token (40 collectives
    for 40 tokens); the line puts as much work in a step as its fixed cost."""
    sizes = _steps(Pace(), lambda n: 0.6 + 0.01 * n, 8)
    assert sizes[:2] == [1, 2]  # the second size tells fixed from per-token cost
    assert sizes[-1] == 60  # 0.6 s of tokens beside 0.6 s fixed
    # A model that slow per token (a second each) keeps one-token steps once told.
    slow = _steps(Pace(), lambda n: 1.0 * n, 8)
    assert slow[:2] == [1, 2] and slow[2:] == [pace_module.FEWEST_TOKENS] * 6


# -- the engine ----------------------------------------------------------------------------


@pytest.fixture
def engine(tiny: Any) -> Engine:
    model, tokenizer = tiny
    return Engine(model, tokenizer)


@pytest.mark.timeout(120)
def test_a_prompt_that_was_one_step_reports_progress_in_several(engine: Engine) -> None:
    messages = _prompt(70)
    assert len(engine.render(messages)) < PREFILL_STEP  # one 512-token step before
    reports: list[int] = []
    result = engine.turn(
        TurnRequest("s", messages, max_tokens=2), on_progress=lambda d, t: reports.append(d)
    )
    steps = engine.prefill_steps
    assert len(steps) >= 3 and steps[0] == FIRST_TOKENS
    assert sum(steps) == result.prompt_tokens - 1  # decode runs the last token
    assert reports == [0, *[sum(steps[: i + 1]) for i in range(len(steps))]]


@pytest.mark.timeout(120)
def test_a_slow_prefill_takes_steps_of_a_fraction_of_a_second(engine: Engine, slow) -> None:
    seconds_per_token = 0.004  # at most 250 tokens/s, whatever the model does
    slow(seconds_per_token)
    engine.turn(TurnRequest("s", _prompt(60), max_tokens=1))
    steps = engine.prefill_steps
    # After the first step, every step is what runs in TARGET_S by the measured cost,
    # which the slowness bounds: never the 512 tokens of a fixed step. (The cost is a
    # line fitted to a few small steps' times, so a step may pass TARGET_S a little.)
    assert len(steps) >= 4
    assert max(steps[1:-1]) <= 1.2 * TARGET_S / seconds_per_token, steps


@pytest.mark.timeout(120)
def test_a_stop_lands_within_a_step_and_the_next_turn_is_fine(engine: Engine, slow) -> None:
    slow(0.004)
    messages = _prompt(200)
    reports: list[int] = []
    stopped = engine.turn(
        TurnRequest("s", messages, max_tokens=4),
        on_progress=lambda d, t: reports.append(d),
        should_stop=lambda: len(reports) >= 3,
    )
    assert stopped.finish_reason == "interrupted" and stopped.generated_tokens == 0
    assert len(engine.prefill_steps) == 2  # the check before the third step stopped it
    assert reports[-1] < stopped.prompt_tokens // 2
    os.environ.pop(SLOW)
    again = engine.turn(TurnRequest("s", [{"role": "user", "content": "hi"}], max_tokens=4))
    assert again.finish_reason in ("stop", "length") and again.generated_tokens > 0


class RankZeroOfTwo:
    """Rank 0 of two pipeline ranks, as the engine sees it: each stop check is a
    collective (here the other rank agrees with rank 0, which alone hears Ctrl-C)."""

    rank, size = 0, 2

    def __init__(self) -> None:
        self.checks = 0

    def any_with(self, flag: bool, value: int) -> tuple[bool, int]:
        self.checks += 1
        return flag, value

    def any(self, flag: bool) -> bool:
        return flag


@pytest.mark.timeout(120)
def test_ctrl_c_on_two_slow_pipeline_ranks_ends_the_prefill_at_the_next_step(
    engine: Engine, slow
) -> None:
    # Issue 45: SmolLM2 on two loaded pipeline ranks runs 2 to 5 tokens/s; its steps of
    # 4 to 8 tokens took seconds, and so did a Ctrl-C. Every step is now what runs in
    # TARGET_S, or one token (the second aside), and the check before the next one ends
    # the turn.
    seconds_per_token = 0.3
    slow(seconds_per_token)
    group = RankZeroOfTwo()
    engine.group = group  # after the engine's start: its cache decisions stay one rank's
    engine.model.pipeline_stages = 2  # each step cut as a pipeline rank cuts it
    pressed = threading.Event()
    after: list[int] = []

    def on_progress(done: int, total: int) -> None:
        if pressed.is_set():
            after.append(done)

    ctrl_c = threading.Timer(1.0, pressed.set)  # 1 s into the prefill
    ctrl_c.start()
    try:
        result = engine.turn(
            TurnRequest("s", _prompt(60), max_tokens=4),
            on_progress=on_progress,
            should_stop=pressed.is_set,
        )
    finally:
        ctrl_c.cancel()
        del engine.model.pipeline_stages
    steps = engine.prefill_steps
    assert result.finish_reason == "interrupted" and result.generated_tokens == 0
    assert len(after) <= 1, after  # the step in flight reported, then nothing more ran
    assert group.checks == len(steps) + 1  # one agreed check per step, and the stopping one
    # Past the second step (twice the first: it tells a step's fixed cost from its
    # tokens', exokv.rank.pace) each is what runs in TARGET_S, or one token.
    assert steps[1] <= 2 * steps[0], steps
    assert max(steps[2:], default=1) <= max(1, int(TARGET_S / seconds_per_token)), steps
    assert sum(steps) < result.prompt_tokens // 2


# -- the time to first token, from the request ---------------------------------------------


def test_the_stopwatch_counts_what_runs_before_the_turn() -> None:
    seen: list[str] = []
    watch = FirstText(seen.append)
    time.sleep(0.2)  # the draft step in flight, say
    watch("")  # a token with no text yet shows nothing
    watch("Hi")
    watch(" there")
    result = TurnResult(
        "s", "Hi there", 3, 0, 3, 2, ttft_s=0.01, decode_tps=1.0, overhead_s=0.0, ranks=1
    )
    assert watch.stamp(result).ttft_s >= 0.2
    assert seen == ["", "Hi", " there"]


@pytest.mark.timeout(180)
def test_a_local_turn_counts_the_draft_step_in_flight(
    models_dir: Path, slow, monkeypatch: pytest.MonkeyPatch
) -> None:
    from exokv.client.local import LocalClient
    from exokv.rank.engine import EngineOptions

    monkeypatch.setenv("EXOKV_HOME", str(models_dir.parent))
    client = LocalClient("builtin:tiny", EngineOptions())
    try:
        slow(0.01)
        client.engine.pace.took(100, 0.5)  # steps of 50 tokens: half a second each
        history = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
        client.draft("s", history, " ".join(f"word{i}" for i in range(200)) + " end")
        time.sleep(0.1)  # the draft's first step is under way
        taken = client._engine_lock.acquire(blocking=False)
        if taken:
            client._engine_lock.release()
        assert not taken, "no draft step in flight"
        first: list[float] = []
        start = time.perf_counter()

        def on_text(piece: str) -> None:
            if piece and not first:
                first.append(time.perf_counter())

        # Timed where the front end hands the turn over (exokv.client.stopwatch).
        chat = ChatController(client, TurnSettings(max_tokens=4), "s")
        chat.current.messages = list(history)
        result = chat.handle("hi", on_text=on_text).result
        assert first, "no text"
        outside = first[0] - start
        # The status line's TTFT is what was measured outside, the wait for the step
        # in flight included (the engine's own clock starts after it).
        assert result.ttft_s >= outside - 0.02, (result.ttft_s, outside)
        assert result.ttft_s <= outside + 0.02
    finally:
        client.close()
    assert threading.active_count() >= 1


# -- the screen from Enter on: a spinner, then the bar -------------------------------------


def test_a_spinner_moves_from_enter_until_the_bar_takes_its_place(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import io

    from rich.console import Console

    import exokv.chat.render as render

    monkeypatch.setattr(render, "SPINNER_AFTER_S", 0.01)
    out = io.StringIO()
    r = render.Renderer(Console(file=out, force_terminal=True, width=120))
    r.begin_turn()
    deadline = time.monotonic() + 5
    while "prefill" not in out.getvalue() and time.monotonic() < deadline:
        time.sleep(0.01)
    shown = ANSI.sub("", out.getvalue())
    assert r._spinner is not None and re.search("[⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏] prefill", shown), shown
    r.on_progress(0, 3000)  # a long prefill: the bar at once, in the spinner's place
    assert r._spinner is None and r._progress is not None
    r.on_progress(1500, 3000)
    r._progress.refresh()
    assert "1,500/3,000 tokens" in out.getvalue()
    r.on_text("hi")
    assert r._progress is None and r._spinner is None
    r.end_turn()


def test_a_quick_answer_gets_no_spinner() -> None:
    import io

    from rich.console import Console

    import exokv.chat.render as render

    out = io.StringIO()
    r = render.Renderer(Console(file=out, force_terminal=True, width=120))
    r.begin_turn()  # /help, say: answered before the spinner is due
    r.end_turn()
    time.sleep(render.SPINNER_AFTER_S * 2)
    assert r._spinner is None and "prefill" not in out.getvalue()
