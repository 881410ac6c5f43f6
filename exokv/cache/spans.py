"""Sets of token positions as sorted, disjoint [start, end) spans (no MLX).

A sliding-window layer keeps only some positions of a node's edge; these spans say
which, the same on every rank, so every rank can count what every other rank holds.
"""

from __future__ import annotations

from collections.abc import Sequence

Span = tuple[int, int]


def total(spans: Sequence[Span]) -> int:
    return sum(b - a for a, b in spans)


def clip(spans: Sequence[Span], start: int, end: int) -> list[Span]:
    """The parts of `spans` inside [start, end)."""
    out = []
    for a, b in spans:
        a, b = max(a, start), min(b, end)
        if a < b:
            out.append((a, b))
    return out


def missing(spans: Sequence[Span], start: int, end: int) -> list[Span]:
    """The parts of [start, end) that `spans` does not hold."""
    out, pos = [], start
    for a, b in spans:
        if b <= pos or a >= end:
            continue
        if a > pos:
            out.append((pos, a))
        pos = max(pos, b)
    if pos < end:
        out.append((pos, end))
    return out


def covers(spans: Sequence[Span], start: int, end: int) -> bool:
    return start >= end or not missing(spans, start, end)


def window_needs(length: int, window: int, keep: int) -> list[Span]:
    """The positions a rotating cache of `window` tokens (the first `keep` pinned)
    holds after `length` tokens, as mlx-lm's RotatingKVCache keeps them."""
    if length <= window:
        return [(0, length)] if length else []
    return [(0, keep), (length - (window - keep), length)] if keep else [(length - window, length)]


def keep_for_end(spans: Sequence[Span], end: int, window: int, keep: int) -> list[Span]:
    """What a node ending at `end` must keep: what a fetch ending at `end` or below it
    can need (a fetch further down needs no more of this edge than its own end does)."""
    out: list[Span] = []
    for a, b in window_needs(end, window, keep):
        out += clip(spans, a, b)
    return sorted(out)
