"""Prefill across pipeline ranks runs in pieces, so the ranks work at once (issue 22).

Each rank evaluates a piece and sends its hidden state on before it starts the next,
so the first stage runs piece k+1 while the last runs piece k. Only the way a step is
cut changes: the stop checks stay one per PREFILL_STEP, and the cache holds what one
piece per step gives. The speed is measured by benchmarks/spec_prefill.py --ranks 2.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from chat_helpers import home_with_models
from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache
from test_cluster import replies, run_script
from zoo_helpers import LONG_MESSAGE

from exokv.model import pipeline
from exokv.rank.engine import PREFILL_STEP, prefill
from exokv.rank.pace import KEPT_GRID, aligned_step


def test_one_stage_runs_the_range_as_one_piece() -> None:
    assert pipeline.micro_chunks(5, 300, 1) == [(5, 300)]
    assert pipeline.micro_chunks(7, 7, 2) == []


def test_pipeline_stages_cut_the_range_into_small_pieces() -> None:
    pieces = pipeline.micro_chunks(10, 10 + 3 * pipeline.MICRO_CHUNK + 5, 2)
    assert len(pieces) == 4
    assert pieces[0][0] == 10 and pieces[-1][1] == 10 + 3 * pipeline.MICRO_CHUNK + 5
    assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:], strict=False))
    assert max(b - a for a, b in pieces) == pipeline.MICRO_CHUNK


class Recording:
    """A model that records the tokens of each call; its cache states are arrays."""

    def __init__(self, stages: int) -> None:
        self.pipeline_stages = stages
        self.calls: list[int] = []

    def __call__(self, tokens: mx.array, cache: Any = None) -> None:
        self.calls.append(tokens.shape[1])


class State:
    state = mx.zeros((1,))


@pytest.mark.parametrize("stages", [1, 2])
def test_stop_checks_stay_one_per_step_whatever_the_pieces(stages: int) -> None:
    model = Recording(stages)
    checked: list[int] = []
    done: list[int] = []
    n = PREFILL_STEP + 100
    prefill(model, [State()], list(range(n)), lambda i: checked.append(i) is not None, done.append)
    assert checked == [0, PREFILL_STEP]
    assert done == [PREFILL_STEP, n]
    assert sum(model.calls) == n
    if stages == 1:
        assert model.calls == [PREFILL_STEP, 100]
    else:
        assert max(model.calls) == pipeline.MICRO_CHUNK
        assert len(model.calls) > 2


def test_a_stop_before_the_second_step_runs_none_of_it() -> None:
    model = Recording(2)
    stopped = prefill(model, [State()], list(range(PREFILL_STEP + 50)), lambda i: i > 0)
    assert stopped is True
    assert sum(model.calls) == PREFILL_STEP


def test_pieces_leave_the_cache_and_logits_one_step_leaves(tiny_qwen: Any) -> None:
    tokens = [(i * 37) % 290 + 5 for i in range(PREFILL_STEP + 77)]

    def run(stages: int) -> tuple[list[mx.array], mx.array]:
        tiny_qwen.pipeline_stages = stages  # cuts the prefill as a pipeline's rank would
        try:
            cache = make_prompt_cache(tiny_qwen)
            prefill(tiny_qwen, cache, tokens)
            logits = tiny_qwen(mx.array([[7]]), cache=cache)
            return [c.state[0] for c in cache], logits
        finally:
            del tiny_qwen.pipeline_stages

    whole_keys, whole_logits = run(1)
    piece_keys, piece_logits = run(2)
    for a, b in zip(whole_keys, piece_keys, strict=True):
        assert a.shape == b.shape
        assert mx.allclose(a, b, atol=1e-4).item()
    assert mx.allclose(whole_logits, piece_logits, atol=1e-4).item()
    assert mx.argmax(whole_logits).item() == mx.argmax(piece_logits).item()


def test_a_rotating_cache_that_keeps_tokens_is_not_cut() -> None:
    # --max-kv-size: each chunk's first token sees the kept tokens, so pieces would
    # change the replies; a sliding window (keep 0) is cut like any cache.
    model = Recording(2)
    kept = RotatingKVCache(max_size=48, keep=4)
    assert not pipeline.cut_freely([State(), kept])
    assert pipeline.cut_freely([State(), RotatingKVCache(max_size=48)])
    prefill(model, [kept], list(range(PREFILL_STEP + 9)))
    # One call per step; past the window the steps end on the grid (the recording
    # model leaves the cache's offset at 0, so each step runs to KEPT_GRID).
    assert model.calls == [KEPT_GRID, KEPT_GRID, 9]


def test_steps_past_a_kept_window_end_on_the_grid_whatever_the_pace() -> None:
    assert aligned_step(0, 8, 48) == 8  # the next step starts inside the window
    assert aligned_step(40, 7, 48) == 7
    assert aligned_step(40, 8, 48) == KEPT_GRID - 40  # it would start past it
    assert aligned_step(KEPT_GRID + 3, 1, 48) == KEPT_GRID - 3
    assert aligned_step(2 * KEPT_GRID, 600, 48) == KEPT_GRID


@pytest.mark.parametrize("start", [0, 5, 30])
def test_a_kept_window_leaves_the_same_logits_from_any_start_and_pace(
    tiny_qwen: Any, start: int
) -> None:
    """--max-kv-size: a turn from a hit at `start` with the pace's one-token first
    step gives the logits of one prefill from nothing in steps of PREFILL_STEP (a
    cut past the window used to change which tokens saw the kept ones)."""
    tokens = [(i * 37) % 290 + 5 for i in range(KEPT_GRID + 140)]

    def last_logits(sizes: list[int] | None, first: int) -> mx.array:
        cache = make_prompt_cache(tiny_qwen, max_kv_size=48)
        assert pipeline.kept_window(cache) is not None
        prefill(tiny_qwen, cache, tokens[:first])
        steps = iter(sizes or [])
        size = None if sizes is None else (lambda: next(steps, 4))
        prefill(tiny_qwen, cache, tokens[first:], size=size)
        return tiny_qwen(mx.array([[7]]), cache=cache)

    reference = last_logits(None, 0)
    paced = last_logits([1, 4, 16, 64, 3, 100], start)
    assert mx.allclose(reference, paced, atol=1e-4).item()


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_three_pipeline_ranks_in_pieces_give_one_ranks_replies(
    tmp_path: Path, models_dir: Path
) -> None:
    # The middle rank receives each piece, runs its layer and sends it on while the
    # first rank runs the next: a prompt of several pieces, then a cached turn.
    lines = [LONG_MESSAGE + " " + LONG_MESSAGE, "And after that?", LONG_MESSAGE]
    one = run_script(home_with_models(tmp_path / "one", models_dir, True), lines)
    home = home_with_models(tmp_path / "three", models_dir, True)
    three = run_script(home, lines, "-n", "3", "--starting-port", "26480")
    assert replies(three) == replies(one)
    assert len(set(replies(one))) > 1
    assert three[0]["prompt_tokens"] > 2 * pipeline.MICRO_CHUNK
    assert all(t["ranks"] == 3 for t in three)
    assert three[1]["cached_tokens"] > 0
