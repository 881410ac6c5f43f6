"""The turn's one collective, and every cache decision made from what it gathered.

Before the turn every rank sends its numbers once (bytes held, budget, pressure, RAM,
the turn's headroom, and its bytes per unit of each storage class); every rank then
evicts the same entries by `policy.plan`. After the turn's insert, the same gathered
numbers and the tree's counts give every rank's bytes exactly, so every rank also
agrees, with no further collective, on what to evict (or cut off the conversation)
to bring every rank within its budget.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from exokv.cache.disk_tier import DiskTier
from exokv.cache.kinds import KV, STATE, StorageClass
from exokv.cache.memory import MemorySample
from exokv.cache.policy import Entry, Eviction, RankLoad, plan_lru
from exokv.cache.prefix_cache import PrefixCache
from exokv.cache.radix import Node, RadixTree
from exokv.collectives import Group
from exokv.core.records import CacheEvent, EntryInfo, RankStats
from exokv.errors import ExokvError

_FIXED = 9  # numbers before the per-class rates in the gathered vector
_DIGEST = 8
_MAX_WINDOWS = 7  # distinct sliding windows a model may use (startup agreement)
# Points a turn stores at most (rank.engine.Engine._stops): where its prompt leaves the tree,
# its prompt's end and its reply's end.
_POINTS = 3


def agree_classes(group: Group, local: Sequence[StorageClass]) -> list[StorageClass]:
    """Every rank's storage classes, the same list on every rank (a startup gather).

    A rank counts what every other rank holds, so it must know their classes even
    where it has no layer of that class (a pipeline rank of a hybrid model).
    """
    windows = sorted(c for c in local if c[0] == "window")
    if len(windows) > _MAX_WINDOWS:
        raise ExokvError(f"the model uses {len(windows)} sliding windows; at most 7 are supported")
    vector = [int(KV in local), int(STATE in local)]
    for i in range(_MAX_WINDOWS):
        vector += list(windows[i][1:]) if i < len(windows) else [-1, -1]
    rows = group.gather(vector) if group.size > 1 else [vector]
    out: set[StorageClass] = set(local)
    for row in rows:
        if row[0]:
            out.add(KV)
        if row[1]:
            out.add(STATE)
        out |= {("window", row[i], row[i + 1]) for i in range(2, len(row), 2) if row[i] >= 0}
    return sorted(out)


@dataclass
class Gathered:
    """One turn's numbers from every rank."""

    rates: list[dict[StorageClass, int]]  # bytes per token (kv, window) or state, per rank
    loads: list[RankLoad]
    rows: list[list[int]]


class Coordinator:
    def __init__(
        self,
        cache: PrefixCache,
        group: Group,
        rates: dict[StorageClass, int],
        budget: int | None,
        threshold: float,
    ) -> None:
        self.cache = cache
        self.group = group
        self.rates = {c: rates.get(c, 0) for c in cache.classes}  # this rank's
        self.budget = budget
        self.threshold = threshold
        self.collectives = 0
        self.last: Gathered | None = None
        self.tier: DiskTier | None = None  # the disk tier under RAM, if any (set_tier)
        # Sessions pinned with /pin: their entries go after every other (each turn's
        # request carries them, so every rank holds the same set).
        self.pins: frozenset[str] = frozenset()

    def set_tier(self, tier: DiskTier) -> None:
        self.tier = tier
        self.cache.tier = tier
        tier.rates = self.all_rates()
        tier.node_bytes = self.node_bytes

    def set_pins(self, sessions: Sequence[str]) -> None:
        """The sessions pinned now (a turn's request says: the same on every rank)."""
        self.pins = frozenset(sessions)
        if self.tier is not None:
            self.tier.pins = self.pins

    def tier_events(self, decision: int) -> list[CacheEvent]:
        """The disk tier's events since the last call (loads, agreed misses, spills)."""
        return self.tier.take_events(decision) if self.tier is not None else []

    def take_written(self) -> list[int]:
        """The nodes whose disk tier files were written since the last call."""
        return self.tier.take_written() if self.tier is not None else []

    def close(self) -> None:
        """Keep the cache for the next run (the disk tier's files); no collective."""
        if self.tier is not None:
            self.tier.close()

    # -- bytes on every rank, from the tree's counts --------------------------------

    def all_rates(self) -> list[dict[StorageClass, int]]:
        """Every rank's rates as last gathered (this rank's alone before any turn)."""
        if self.last is not None:
            return self.last.rates
        return [self.rates] * self.group.size

    def node_bytes(self, node: Node) -> list[int]:
        return _bytes(self.cache.counts(node), self.all_rates())

    def held_bytes(self) -> list[int]:
        return _bytes(self.cache.totals, self.all_rates())

    def headroom(self, new_tokens: int, copied: int = 0) -> int:
        """Most bytes this turn's inserts can add on this rank: every new token's K/V,
        and for each of the points a turn stores (at most `_POINTS`) a window for each
        sliding window and a state. `copied`: tokens of full-attention K/V the turn's
        cache holds beside the tree's copy."""
        total = 0
        for c, rate in self.rates.items():
            if c == KV:
                total += (new_tokens + copied) * rate
            elif c == STATE:
                total += _POINTS * rate
            else:
                total += min(new_tokens + c[1], _POINTS * c[1]) * rate
        return total

    # -- before the turn: the one collective and the plan ---------------------------

    def begin(
        self,
        decision: int,
        new_tokens: int,
        probe: MemorySample,
        events: list[CacheEvent],
        copied: int = 0,
    ) -> None:
        """Gather every rank's numbers once, plan, and evict the same entries everywhere."""
        local = [
            self.cache.total_bytes,
            -1 if self.budget is None else self.budget,
            int(probe.pressure * 1_000_000),
            probe.ram_total,
            self.headroom(new_tokens, copied),
            probe.rss,
            probe.mlx_active,
            sum(r for c, r in self.rates.items() if c != STATE),
            self.cache.tree.digest,  # kept by the tree as it changes
            *(self.rates[c] for c in self.cache.classes),
        ]
        if self.tier is not None:  # disk tier: its budget and write status, at the end
            local += self.tier.local_numbers()
        self.collectives += 1
        rows = self.group.gather(local)
        if len({row[_DIGEST] for row in rows}) != 1:
            raise ExokvError("ranks hold different cache trees (they diverged); restart the chat")
        n = len(self.cache.classes)
        rates = [
            dict(zip(self.cache.classes, row[_FIXED : _FIXED + n], strict=True)) for row in rows
        ]
        held = _bytes(self.cache.totals, rates)
        loads = [
            RankLoad(
                cache_bytes=held[r],
                budget=None if row[1] < 0 else row[1],
                pressure=row[2] / 1_000_000,
                ram=row[3],
                headroom=row[4],
            )
            for r, row in enumerate(rows)
        ]
        self.last = Gathered(rates=rates, loads=loads, rows=rows)
        if self.tier is not None:
            self.tier.decision = decision
            self.tier.absorb(rows, rates)
        self._evict(loads, decision, events)

    # -- after the turn: every rank within its budget -------------------------------

    def store(
        self,
        tokens: Sequence[int],
        cache: list[Any],
        length: int,
        session: str,
        decision: int,
        events: list[CacheEvent],
    ) -> tuple[list[Node], list[Node]]:
        """Insert the first `length` tokens of `tokens` (what `cache` has run) and record
        the entries it changed and added; returns (added, changed) as `PrefixCache.insert`.
        What the tree holds after it follows from the tokens alone, on every rank."""
        added, changed = self.cache.insert(tokens, cache, session, length=length)
        events += [self.event("update", n, session, decision) for n in changed]
        events += [self.event("add", n, session, decision) for n in added]
        return added, changed

    def cap(
        self, decision: int, live: list[Node], tokens: int, session: str, events: list[CacheEvent]
    ) -> None:
        """Evict, by the gathered numbers, until every rank holds at most its budget:
        other entries first (least recently used), then the end of the live conversation
        (`live`, the path of its `tokens` tokens), keeping its longest prefix that fits."""
        g = self.last
        if g is None or not self._over():  # the common case: a look at the totals only
            return
        loads = [
            RankLoad(cache_bytes=b, budget=load.budget, pressure=0.0, ram=load.ram)
            for b, load in zip(self.held_bytes(), g.loads, strict=True)
        ]
        self._evict(loads, decision, events, kept=set(live))
        path = [n for n in live if n.payload is not None]
        while path and self._over():
            node = path[-1]
            keep = self._longest_fit(node)
            reason = f"over budget: kept {node.start + keep} of {tokens} tokens"
            pressures = [load.pressure for load in g.loads]
            if keep:
                head = self.cache.cut(node, keep)
                events.append(self.event("add", head, session, decision))
            self._remove(node, self._evict_event(node, decision, reason, pressures), events)
            path.pop()

    def finish(
        self, decision: int, events: list[CacheEvent]
    ) -> tuple[list[RankStats], list[EntryInfo]]:
        """A turn's last cache work, after its cap: the disk tier's events, its
        write-through and journal record of what the turn changed (written after the
        reply), then every rank's figures and the entries the turn changed."""
        events += self.tier_events(decision)
        changed = self.cache.tree.drain_changed()
        if self.tier is not None:
            self.tier.after_turn(changed)
        return self.stats(), self.changed_entries(changed)

    def _over(self) -> bool:
        budgets = [load.budget for load in self.last.loads]
        return any(b is not None and h > b for h, b in zip(self.held_bytes(), budgets, strict=True))

    def _longest_fit(self, node: Node) -> int:
        """The most tokens of leaf `node` that every rank can keep (0: none).

        Only where every layer can be cut at any token: elsewhere the cut-off head's
        end would have no state or window there, so it could never be a hit."""
        if not self.cache.exact_anywhere:
            return 0
        rates = self.all_rates()
        budgets = [load.budget for load in self.last.loads]
        without = [h - b for h, b in zip(self.held_bytes(), self.node_bytes(node), strict=True)]

        def fits(k: int) -> bool:
            head = _bytes(self.cache.head_counts(node, k), rates)
            return all(
                b is None or w + h <= b for w, h, b in zip(without, head, budgets, strict=True)
            )

        lo, hi = 0, len(node.key) - 1  # fits(lo) holds once the whole leaf is gone
        if not fits(0):
            return 0
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if fits(mid):
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _evict(
        self,
        loads: list[RankLoad],
        decision: int,
        events: list[CacheEvent],
        kept: set[Node] | None = None,
    ) -> None:
        """Evict by the plan, the same entries on every rank; `kept` are not candidates."""
        rates = self.last.rates
        planned = plan_tree(
            self.cache.tree,
            lambda node: _bytes(self.cache.counts(node), rates),
            loads,
            self.threshold,
            kept or set(),
            self.pins,
        )
        pressures = [load.pressure for load in self.last.loads]
        # The plan is complete before anything is evicted: the leaf order it read changes.
        for eviction in planned:
            node = self.cache.tree.find(eviction.entry)
            event = self._evict_event(node, decision, eviction.reason, pressures)
            self._remove(node, event, events)

    def _remove(self, node: Node, event: CacheEvent, events: list[CacheEvent]) -> None:
        """Evict `node` from RAM: to the disk tier when there is one (a spill), else away."""
        if self.tier is None:
            events.append(event)
            self.cache.evict(node)
            return
        self.tier.remove(node, event.reason, event)
        events += self.tier.take_events(event.decision)

    def _evict_event(
        self, node: Node, decision: int, reason: str, pressures: list[float]
    ) -> CacheEvent:
        return CacheEvent(
            kind="evict",
            decision=decision,
            entry=node.id,
            tokens=len(node.key),
            bytes=self.node_bytes(node),
            session=node.session,
            reason=reason,
            pressures=pressures,
        )

    # -- reporting ------------------------------------------------------------------

    def event(self, kind: str, node: Node, session: str, decision: int, hit: int = 0) -> CacheEvent:
        return CacheEvent(
            kind=kind,
            decision=decision,
            entry=node.id,
            tokens=len(node.key),
            bytes=self.node_bytes(node),
            session=session,
            hit_length=hit,
        )

    def stats(self) -> list[RankStats]:
        """Every rank's figures after the turn: bytes exact from the tree's counts."""
        g = self.last
        assert g is not None
        held = self.held_bytes()
        # This rank's own figure is what it holds, measured; the others' are computed
        # from the tree's counts (equal when the accounting is exact, as tests check).
        held[self.group.rank] = self.cache.total_bytes
        entries = len(self.cache.tree)
        disk = self.tier.disk_bytes() if self.tier is not None else [0] * len(g.rows)
        disk_budgets = self.tier.budgets if self.tier is not None else [None] * len(g.rows)
        return [
            RankStats(
                rank=r,
                cache_bytes=held[r],
                entries=entries,
                budget=None if row[1] < 0 else row[1],
                pressure=row[2] / 1_000_000,
                ram_total=row[3],
                rss=row[5],
                mlx_active=row[6],
                disk_bytes=disk[r],
                disk_budget=disk_budgets[r],
                replica_bytes=self.tier.replica_bytes(r) if self.tier is not None else 0,
            )
            for r, row in enumerate(g.rows)
        ]

    def entries(self) -> list[EntryInfo]:
        """Every live entry (a walk of the whole tree: for inspection, not per turn)."""
        return [self._entry_info(node) for node in self.cache.tree.nodes()]

    def changed_entries(self, changed: list[Node] | None = None) -> list[EntryInfo]:
        """The entries added or changed since the last call (the store keeps the rest);
        `changed`: the tree's list, when the caller drained it already."""
        if changed is None:
            changed = self.cache.tree.drain_changed()
        return [self._entry_info(n) for n in changed if self.cache.tree.find(n.id) is n]

    def _entry_info(self, node: Node) -> EntryInfo:
        return EntryInfo(
            id=node.id,
            parent=node.parent.id if node.parent and node.parent.parent else None,
            session=node.session,
            tokens=len(node.key),
            depth=node.depth,
            bytes=self.node_bytes(node),
            hits=node.hits,
            last_used=node.last_used,
            tier=node.payload.tier,
        )


def plan_tree(
    tree: RadixTree,
    sizes_of: Callable[[Node], list[int]],
    loads: Sequence[RankLoad],
    threshold: float,
    kept: set[Node] | frozenset[Node] = frozenset(),
    pins: frozenset[str] = frozenset(),
) -> list[Eviction]:
    """`policy.plan_lru` over what the tree holds resident (in RAM), read lazily from
    the tree's own LRU order of resident leaves, so the cost is the evictions', not
    the tree's size. Without a disk tier every node is resident: the tree's leaves.
    On-disk nodes are not entries: a RAM node whose children are all on disk is a
    leaf, and a parent becomes one when its last RAM child goes. `kept` nodes are
    never evicted; the leaves of `pins` sessions come after every other leaf (a pass
    over the LRU order for each; only with pins is the second one taken)."""

    def entry(node: Node) -> Entry:
        parent = node.parent.id if node.parent is not None and node.parent.parent else None
        locked = node.locks > 0 or node in kept
        return Entry(node.id, parent, node.last_used, locked, node.session in pins)

    def entry_of(node_id: int) -> Entry | None:
        node = tree.find(node_id)
        return None if node is None else entry(node)

    def leaves(pinned: bool) -> Iterator[Entry]:
        for n in tree.lru_leaves():
            if n not in kept and (n.session in pins) == pinned:
                yield entry(n)

    in_order = itertools.chain(leaves(False), leaves(True)) if pins else leaves(False)
    return plan_lru(
        in_order,
        entry=entry_of,
        children=lambda node_id: tree.find(node_id).resident_children,
        sizes_of=lambda node_id: sizes_of(tree.find(node_id)),
        ranks=loads,
        threshold=threshold,
    )


def _bytes(counts: dict[StorageClass, int], rates: Sequence[dict[StorageClass, int]]) -> list[int]:
    return [sum(n * rate.get(c, 0) for c, n in counts.items()) for rate in rates]
