"""The eviction plan: a pure function of numbers that every rank holds identically.

Every input is either derived from the token tree (the same on every rank) or was
gathered from all ranks in one collective, so every rank computes the same plan.
A rank's own bytes or RAM never decide alone: the plan evicts for the worst rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Entry:
    """A tree node as the policy sees it."""

    id: int
    parent: int | None
    last_used: int
    locked: bool = False


@dataclass(frozen=True)
class RankLoad:
    """One rank's gathered numbers.

    budget: most cache bytes this rank may hold (None: no byte budget).
    headroom: bytes the coming prefill and decode will add on this rank.
    pressure: fraction of the rank's RAM in use; ram: the rank's RAM in bytes.
    """

    cache_bytes: int
    budget: int | None
    pressure: float
    ram: int
    headroom: int = 0


@dataclass(frozen=True)
class Eviction:
    entry: int
    reason: str


def plan(
    entries: Sequence[Entry],
    sizes: Sequence[Sequence[int]],
    ranks: Sequence[RankLoad],
    threshold: float,
) -> list[Eviction]:
    """Which entries to evict, in order: least recently used unlocked leaves first.

    sizes[r][i] is the bytes entries[i] holds on rank r. Evicts while any rank is
    over its budget (counting headroom) or its pressure is over `threshold`,
    estimating the pressure a freed byte relieves on that rank.
    """
    if len(sizes) != len(ranks):
        raise ValueError("sizes and ranks must have one row per rank")
    index = {e.id: i for i, e in enumerate(entries)}
    children = {e.id: 0 for e in entries}
    for e in entries:
        if e.parent in children:
            children[e.parent] += 1
    held = [r.cache_bytes for r in ranks]
    freed = [0] * len(ranks)
    alive = set(index)
    evictions: list[Eviction] = []
    while True:
        reason = _worst_rank(ranks, held, freed, threshold)
        if reason is None:
            return evictions
        leaves = [
            entries[index[i]] for i in alive if children[i] == 0 and not entries[index[i]].locked
        ]
        if not leaves:
            return evictions
        victim = min(leaves, key=lambda e: (e.last_used, e.id))
        alive.remove(victim.id)
        if victim.parent in children:
            children[victim.parent] -= 1
        for r in range(len(ranks)):
            size = sizes[r][index[victim.id]]
            held[r] -= size
            freed[r] += size
        evictions.append(Eviction(entry=victim.id, reason=reason))


def _worst_rank(
    ranks: Sequence[RankLoad], held: Sequence[int], freed: Sequence[int], threshold: float
) -> str | None:
    """The reason to evict one more entry, naming the rank furthest over its limit."""
    worst: tuple[float, str] | None = None
    for r, load in enumerate(ranks):
        if load.budget is not None and held[r] + load.headroom > load.budget:
            over = (held[r] + load.headroom - load.budget) / max(load.budget, 1)
            if worst is None or over > worst[0]:
                worst = (over, f"budget rank {r}")
        pressure = load.pressure - freed[r] / max(load.ram, 1)
        if pressure > threshold:
            over = pressure - threshold
            if worst is None or over > worst[0]:
                worst = (over, f"pressure rank {r}")
    return None if worst is None else worst[1]
