"""`exokv serve`'s default batch (exokv.serve.rows): rows from the ranks' budgets."""

from __future__ import annotations

from exokv.serve.rows import MLX_LM_ROWS, PROMPT_ROOM, default_batch, row_tokens

KV = 3072  # bytes per token of K/V (builtin:base's order of size)
GB = 1 << 30


def test_memory_that_allows_32_rows_or_more_gives_32_or_more() -> None:
    assert default_batch([20 * GB], [KV], 2048, 256, queue=64) == 64  # up to --queue
    assert default_batch([20 * GB], [KV], 2048, 256, queue=1) == MLX_LM_ROWS
    per_row = KV * row_tokens(256, None)
    assert default_batch([40 * per_row], [KV], None, 256, queue=8) == MLX_LM_ROWS
    assert default_batch([40 * per_row], [KV], None, 256, queue=64) == 40


def test_tight_memory_gives_fewer_rows_never_none() -> None:
    per_row = KV * row_tokens(256, None)
    assert default_batch([5 * per_row + 1], [KV], None, 256, queue=64) == 5
    assert default_batch([per_row - 1], [KV], None, 256, queue=64) == 1
    assert default_batch([0], [KV], None, 256, queue=64) == 1  # --cache-budget 0


def test_the_tightest_rank_decides_and_unknowns_do_not_limit() -> None:
    per_row = KV * row_tokens(256, None)
    assert default_batch([100 * per_row, 10 * per_row], [KV, KV], None, 256, 64) == 10
    assert default_batch([None, 10 * per_row], [KV, KV], None, 256, 64) == 10
    assert default_batch([per_row], [], None, 256, 64) == 64  # a client that does not say


def test_a_row_is_its_reply_and_prompt_room_within_the_context() -> None:
    assert row_tokens(256, None) == 256 + PROMPT_ROOM
    assert row_tokens(256, 1024) == 1024
    # A short context holds more rows in the same budget.
    budget = 40 * KV * row_tokens(256, None)
    assert default_batch([budget], [KV], 512, 256, 256) > default_batch(
        [budget], [KV], None, 256, 256
    )
