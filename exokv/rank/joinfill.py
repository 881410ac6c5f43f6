"""Several newcomers' prefill chunks in one forward pass (a batch's joining rows).

At a decode step of a batch (exokv.rank.batch) the rows still prefilling get one
chunk of `size` tokens of work, so a decoding row waits at most that long. Rows'
slices run together, right-padded to the widest (as mlx-lm's prompt batches do):
the pass costs rows x width tokens, and that is what must stay within `size`. So the
first row (first come first) sets the width, its rest of the prompt up to `size`, and
the rows after it join with as much of theirs as the width takes while the pass
still fits: many short newcomers (each its question after a shared system prompt)
are prefilled in one pass, a long one runs as wide as a chunk allows.

A row whose prompt shares, beyond what the tree holds, more than half of what it
lacks with an earlier row still prefilling does not start yet: that row stores its
prompt when done (a shared system prompt), and this one then fetches it instead of
prefilling it again.

Everything here is decided from tokens and the tree, the same on every rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

from exokv.model import pipeline


def widths(rests: Sequence[int], size: int) -> list[int]:
    """Each row's tokens in this step's pass, first come first (`rests`: each row's
    prompt tokens left, all above 0): as many rows as fit `size` padded tokens."""
    if not rests:
        return []
    width = max(1, min(rests[0], size))
    out = [width]
    for rest in rests[1:]:
        if (len(out) + 1) * width > size:
            break
        out.append(min(rest, width))
    return out


def waits_for(tokens: Sequence[int], held: int, earlier: Sequence[Sequence[int]]) -> bool:
    """Whether a row of `tokens` (the tree holds `held` of them) should wait for one of
    the `earlier` rows still prefilling: one whose prompt covers more than half of
    what the tree lacks of this one's (it is fetched once that row stores it)."""
    lacking = len(tokens) - 1 - held  # its last token is the next step's, never prefilled
    if lacking <= 1:
        return False
    k = held + lacking // 2 + 1
    head = list(tokens[:k])
    return any(len(other) - 1 >= k and list(other[:k]) == head for other in earlier)


def prefill_together(
    model: Any, caches: list[list[Any]], slices: list[list[int]]
) -> list[list[Any]]:
    """Run every row's slice into its cache in one forward pass (right-padded to the
    widest; pieces across pipeline stages, as a lone prefill's); each row's cache out,
    plain K/V again, holding exactly its own tokens."""
    rows, width = len(slices), max(len(s) for s in slices)
    batch = [BatchKVCache.merge(list(layer)) for layer in zip(*caches, strict=True)]
    padding = [width - len(s) for s in slices]
    tokens = mx.array([list(s) + [0] * p for s, p in zip(slices, padding, strict=True)])
    for c in batch:
        c.prepare(right_padding=padding)
    for start, stop in pipeline.micro_chunks(0, width, pipeline.stages(model)):
        model(tokens[:, start:stop], cache=batch)
        mx.eval([c.state for c in batch])
    for c in batch:
        c.finalize()
    out: list[list[Any]] = [[] for _ in range(rows)]
    for c in batch:
        for i in range(rows):
            own: KVCache = c.extract(i)
            out[i].append(own)
    mx.eval([c.keys for row in out for c in row])
    return out
