"""A batch's vacant slots: a row that ends leaves its place, and a newcomer takes it.

Taking an ended row out of mlx-lm's `BatchKVCache` (`filter`) gathers every other row's
K/V into a new array, and adding a newcomer (`extend`) pads and concatenates them all
again: two copies of the whole batch per request served. On this machine, builtin:base
with 64 rows of ~760 tokens, a filter took 89 ms and an extend 225 ms (16 rows: 16 ms
and 29 ms), against a decode step of the same order; requests arriving and ending
all the time paid them at nearly every step. A vacant slot costs instead a row of
compute per step while it waits, so a newcomer whose cache fits is written into it
(the K/V of its tokens at the slot's end, its padding masked as a merge pads it), and
the vacancies that wait too long are removed in one filter (`compact_now`).

Everything here is decided from Python numbers the same on every rank (slot indices,
step counts, token counts), never from a timing, so the ranks' batches stay alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

# A vacancy waits at most this many steps, or a quarter of the live rows' count if that
# is more, for a newcomer (one more row's compute per step, against a filter's copy of
# every row): a batch that stops receiving newcomers compacts within a few steps.
PATIENCE_STEPS = 4
# Left padding that no live row uses (positions every row attends over, masked): more
# than this, and more than a quarter of the batch's length, is trimmed by a filter.
# Filling vacancies never trims it, as a filter does when the longest row ends.
IDLE_PADDING = 64


def fits(layers: Sequence[Any], cache: Sequence[Any]) -> bool:
    """Whether a row's own cache (plain K/V per layer) fits a slot of the batch: it
    holds no more tokens than the batch's length (else it is extended instead)."""
    first = layers[0]
    return first.keys is not None and cache[0].offset <= first._idx


def place(layers: Sequence[Any], slot: int, cache: Sequence[Any]) -> None:
    """Write a row's own cache into `slot` of the batch's caches (queued, in place when
    MLX can reuse the buffer): its tokens right-aligned to the batch's length, the
    rest of the slot left padding, as `BatchKVCache.merge` and `extend` align it."""
    for batch, own in zip(layers, cache, strict=True):
        n, end = own.offset, batch._idx
        start = end - n
        if n:
            batch.keys[slot : slot + 1, :, start:end, :] = own.keys[..., :n, :]
            batch.values[slot : slot + 1, :, start:end, :] = own.values[..., :n, :]
        batch.left_padding[slot] = start
        batch.offset[slot] = n


def compact_now(vacant: dict[int, int], step: int, live: int, length: int, longest: int) -> bool:
    """Whether to remove the vacancies (and trim idle padding) at this step: the oldest
    vacancy has waited its patience, or the live rows leave more than IDLE_PADDING
    (and a quarter) of the batch's `length` unused before the `longest` live row's
    tokens."""
    if vacant and step - min(vacant.values()) >= max(PATIENCE_STEPS, live // 4):
        return True
    idle = length - longest
    return idle > IDLE_PADDING and 4 * idle > length


def keep(vacant: dict[int, int], rows: int) -> mx.array:
    """The batch indices that are not vacant, in order (a filter's argument)."""
    return mx.array([j for j in range(rows) if j not in vacant])
