"""How many requests `exokv serve` decodes together when `--batch` is not given.

A row's K/V lives beside the prefix cache, in the rank's cache budget (each row's
turn asks the budget for its headroom, and the tree gives way to it): so a rank holds
as many rows as its budget has room for, each row its prompt and its reply, and the
batch as many as its tightest rank holds. A row is counted at the server's default
reply length plus PROMPT_ROOM tokens of prompt (never past the model's context):
most requests are shorter, and one that is longer only eats into what the tree keeps.

Where memory allows, the batch holds at least mlx_lm.server's 32 rows and every
request the queue admits (`--queue`): a request then never waits for another row to
end before it joins; on a tight rank, fewer, never none.
"""

from __future__ import annotations

from collections.abc import Sequence

# mlx_lm.server decodes this many requests at once (its --decode-concurrency).
MLX_LM_ROWS = 32
# A row's prompt, counted on top of its reply: a system prompt and a few turns.
PROMPT_ROOM = 2048


def row_tokens(max_tokens: int, context: int | None) -> int:
    """The tokens one row is counted at: its prompt room and reply, within the context."""
    tokens = max_tokens + PROMPT_ROOM
    return min(tokens, context) if context else tokens


def default_batch(
    budgets: Sequence[int | None],
    kv_per_token: Sequence[int],
    context: int | None,
    max_tokens: int,
    queue: int,
) -> int:
    """The rows decoded together at most: as many as the tightest rank's budget holds
    (`budgets` and `kv_per_token`, bytes, one of each per rank; a rank without a budget
    or K/V does not limit it), up to the larger of MLX_LM_ROWS and `queue`; at least 1."""
    most = max(MLX_LM_ROWS, queue)
    per_row = row_tokens(max_tokens, context)
    rows = most
    for budget, rate in zip(budgets, kv_per_token, strict=False):
        if budget is not None and rate > 0:
            rows = min(rows, budget // (rate * per_row))
    return max(1, rows)
