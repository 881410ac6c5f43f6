"""The eviction plan: a pure function of numbers that every rank holds identically.

Every input is either derived from the token tree (the same on every rank) or was
gathered from all ranks in one collective, so every rank computes the same plan.
A rank's own bytes or RAM never decide alone: the plan evicts for the worst rank.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Entry:
    """A tree node as the policy sees it."""

    id: int
    parent: int | None
    last_used: int
    locked: bool = False
    pinned: bool = False  # a pinned conversation's (/pin): evicted after every unpinned entry

    @property
    def order(self) -> tuple[bool, int, int]:
        """Its place in the eviction order: unpinned before pinned, then least recently
        used first (ties: lower id first)."""
        return (self.pinned, self.last_used, self.id)


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


def plan_lru(
    leaves: Iterable[Entry],
    entry: Callable[[int], Entry | None],
    children: Callable[[int], int],
    sizes_of: Callable[[int], Sequence[int]],
    ranks: Sequence[RankLoad],
    threshold: float,
) -> list[Eviction]:
    """Which entries to evict, in order: unlocked leaves by `Entry.order` (every
    unpinned one before any pinned one, least recently used first).

    Costs O(evictions x log) however many entries there are, so the caller hands
    over its entries lazily:
    - leaves: the unlocked leaves in `Entry.order` (unpinned ones least recently used
      first, then pinned ones the same way); only as many are taken as are evicted,
      plus one.
    - entry(id): the entry `id` (an evicted entry's parent); None if it is not
      one (the tree's root).
    - children(id): how many children the entry has before any eviction.
    - sizes_of(id): the bytes the entry holds on each rank, one number per rank.

    Evicts while any rank is over its budget (counting headroom) or its pressure
    is over `threshold`, estimating the pressure a freed byte relieves on that
    rank. A parent whose last child goes becomes a leaf, and a candidate.
    """
    stream = iter(leaves)
    upcoming = next(stream, None)
    exposed: list[tuple[tuple[bool, int, int], Entry]] = []  # parents made leaves by this plan
    left: dict[int, int] = {}  # children a parent still has
    held = [r.cache_bytes for r in ranks]
    freed = [0] * len(ranks)
    evictions: list[Eviction] = []
    while True:
        reason = _worst_rank(ranks, held, freed, threshold)
        if reason is None:
            return evictions
        if exposed and (upcoming is None or exposed[0][0] < upcoming.order):
            victim = heapq.heappop(exposed)[1]
        elif upcoming is not None:
            victim, upcoming = upcoming, next(stream, None)
        else:
            return evictions
        parent = entry(victim.parent) if victim.parent is not None else None
        if parent is not None:
            n = left.get(parent.id)
            n = (children(parent.id) if n is None else n) - 1
            left[parent.id] = n
            if n == 0 and not parent.locked:
                heapq.heappush(exposed, (parent.order, parent))
        sizes = sizes_of(victim.id)
        if len(sizes) != len(ranks):
            raise ValueError("sizes_of must give one number per rank")
        for r, size in enumerate(sizes):
            held[r] -= size
            freed[r] += size
        evictions.append(Eviction(entry=victim.id, reason=reason))


def plan(
    entries: Sequence[Entry],
    sizes: Sequence[Sequence[int]],
    ranks: Sequence[RankLoad],
    threshold: float,
) -> list[Eviction]:
    """plan_lru over a list of every entry: sizes[r][i] is the bytes entries[i] holds
    on rank r. O(entries x log) to sort the list; plan_lru with a tree's own
    leaf order avoids even that."""
    if len(sizes) != len(ranks):
        raise ValueError("sizes and ranks must have one row per rank")
    index = {e.id: i for i, e in enumerate(entries)}
    children = dict.fromkeys(index, 0)
    for e in entries:
        if e.parent in children:
            children[e.parent] += 1
    leaves = sorted(
        (e for e in entries if children[e.id] == 0 and not e.locked),
        key=lambda e: e.order,
    )
    return plan_lru(
        leaves,
        entry=lambda i: entries[index[i]] if i in index else None,
        children=children.__getitem__,
        sizes_of=lambda i: [row[index[i]] for row in sizes],
        ranks=ranks,
        threshold=threshold,
    )


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
