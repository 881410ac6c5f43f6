"""Binds radix-tree nodes to mlx-lm cache objects: fetch a prefix, insert a turn, evict.

One tree for every kind of layer (see exokv.cache.kinds). Each node owns, for its
edge's tokens: the K/V slices of every full-attention layer; the slices of every
sliding-window layer at the positions a fetch ending at this node or below it can
still need (the `keep` first tokens and the last window before the node's end);
and, where a turn reached the node's end, a copy of every state layer. A fetch is
usable only where every layer can be rebuilt, so the hit falls back to the deepest
such point: the same on every rank, since it is computed from the tree alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from exokv.cache import kinds, spans
from exokv.cache.kinds import KV, STATE, StorageClass
from exokv.cache.radix import Node, RadixTree

SEQ_AXIS = kinds.SEQ_AXIS


@dataclass
class Payload:
    """What one node holds. `spans` and `state` are the tree's record (identical on every
    rank, whatever layers a rank holds); the arrays are this rank's."""

    start: int  # position of the edge's first token
    kv: list[Any] = field(default_factory=list)  # per kv leaf: (keys, values) of the edge
    spans: dict[StorageClass, list[spans.Span]] = field(default_factory=dict)
    windows: list[list[Any]] = field(default_factory=list)  # per window leaf, one per span
    state: bool = False
    states: list[Any] = field(default_factory=list)  # per state leaf, when `state`
    nbytes: int = 0
    tier: str = "ram"  # "disk": the arrays are in this rank's disk tier (exokv.cache.disk_tier)


@dataclass
class Hit:
    """A fetched prefix: a fresh cache holding `length` tokens, and the nodes it came from.

    `lent`: path nodes whose K/V the cache holds for the turn instead of a copy (see
    `PrefixCache.fetch`); `PrefixCache.give_back` returns it to them."""

    cache: list[Any]
    length: int
    path: list[Node]
    lent: list[Node] = field(default_factory=list)

    @property
    def entry(self) -> Node | None:
        return self.path[-1] if self.path else None


def cache_length(cache: Sequence[Any]) -> int:
    return kinds.offset(cache)


class PrefixCache:
    def __init__(
        self,
        make_cache: Callable[[], list[Any]],
        classes: Sequence[StorageClass] = (),
    ) -> None:
        """`classes`: the storage classes of every rank (this rank's are added), so the
        tree counts what ranks with other layers hold too."""
        self._make_cache = make_cache
        self.leaves = kinds.leaves(make_cache())
        self.classes: list[StorageClass] = sorted(set(classes) | {leaf.cls for leaf in self.leaves})
        self.kv_leaves = [leaf for leaf in self.leaves if leaf.cls == KV]
        self.window_leaves = [leaf for leaf in self.leaves if leaf.cls[0] == "window"]
        self.state_leaves = [leaf for leaf in self.leaves if leaf.cls == STATE]
        self.window_classes = [c for c in self.classes if c[0] == "window"]
        # The tree sums payload bytes, lists the nodes a turn changed (for the store) and
        # keeps the LRU orders of RAM leaves and of on-disk leaves (for the disk tier).
        self.tree = RadixTree(size_of=_payload_size, resident=_in_ram)
        self.totals: dict[StorageClass, int] = dict.fromkeys(self.classes, 0)
        self._bytes = 0
        self.tier: Any = None  # exokv.cache.disk_tier.DiskTier, when there is a disk tier

    def new_cache(self) -> list[Any]:
        return self._make_cache()

    @property
    def exact_anywhere(self) -> bool:
        """Whether any token of any path can be a hit (every layer is full attention)."""
        return self.classes == [KV]

    # -- counts: what the tree holds, per storage class ------------------------------

    def counts(self, node: Node) -> dict[StorageClass, int]:
        p: Payload | None = node.payload
        out = dict.fromkeys(self.classes, 0)
        if p is None:
            return out
        if KV in out:
            out[KV] = len(node.key)
        for c in self.window_classes:
            out[c] = spans.total(p.spans.get(c, []))
        if STATE in out:
            out[STATE] = int(p.state)
        return out

    def head_counts(self, node: Node, k: int) -> dict[StorageClass, int]:
        """What `node` would count once cut after its first k tokens (see `cut`)."""
        out = dict.fromkeys(self.classes, 0)
        if KV in out:
            out[KV] = k
        for c in self.window_classes:
            head = spans.clip(node.payload.spans[c], node.start, node.start + k)
            out[c] = spans.total(spans.keep_for_end(head, node.start + k, *c[1:]))
        return out

    def entry_bytes(self, node: Node) -> int:
        return node.payload.nbytes if node.payload is not None else 0

    @property
    def total_bytes(self) -> int:
        return self._bytes

    # -- lookup -----------------------------------------------------------------

    def held(self, tokens: Sequence[int]) -> int:
        """How many of `tokens` the tree holds (usable or not): from the tree alone, so
        the same on every rank."""
        return self.tree.match(tokens).length

    def path(self, tokens: Sequence[int]) -> list[Node]:
        """The entries `tokens` runs through, root first."""
        return self.tree.match(tokens).path

    def usable(self, path: Sequence[Node], limit: int) -> int:
        """The deepest point at or below `limit` on `path` where every layer can be rebuilt."""
        ends = [n.depth for n in reversed(path) if n.depth < limit]
        for length in [limit, *ends, 0]:
            if self._rebuildable(path, length):
                return length
        return 0

    def _rebuildable(self, path: Sequence[Node], length: int) -> bool:
        if length == 0:
            return True
        if STATE in self.classes and not any(n.depth == length and n.payload.state for n in path):
            return False
        for c in self.window_classes:
            held = sorted(s for n in path if n.start < length for s in n.payload.spans[c])
            if not all(spans.covers(held, a, b) for a, b in spans.window_needs(length, *c[1:])):
                return False
        return True

    def fetch(self, tokens: Sequence[int], expect: int = 0, lend: bool = False) -> Hit:
        """The longest usable cached prefix of `tokens`, leaving at least one token to run.

        The returned cache is a fresh object: running the model on it never changes
        what the tree stores. Its full-attention buffers have room for `expect`
        tokens (rounded up to mlx-lm's step), so the turn's tokens need no
        reallocation. With `lend`, the path nodes the hit covers whole hand their
        K/V to the cache instead of keeping a copy beside it (the conversation is
        then held once during the turn); `give_back` must follow. The path is
        locked until `release`.
        """
        match = self.tree.match(tokens)
        length = self.usable(match.path, max(0, min(match.length, len(tokens) - 1)))
        used = [n for n in match.path if n.start < length]
        if self.tier is not None:  # disk tier: bring on-disk nodes back, agreed by every rank
            usable = self.tier.load(used)
            if usable < len(used):
                length = self.usable(used[:usable], min(length, used[usable].start))
                used = [n for n in used[:usable] if n.start < length]
        lent = [n for n in used if n.depth <= length] if lend else []
        cache = self._build(used, length, expect, lent)
        if length > 0:
            self.tree.touch(used)
            for node in used:
                node.hits += 1
        self.tree.lock(used)
        return Hit(cache=cache, length=length, path=used, lent=lent)

    def release(self, hit: Hit) -> None:
        self.give_back(hit)
        self.tree.unlock(hit.path)

    def give_back(self, hit: Hit) -> None:
        """Return lent K/V to its nodes, copied out of the turn's cache (whose first
        `hit.length` tokens the model never writes), one layer's keys or values at a
        time, each dropped from the turn's cache once copied: the conversation is
        never held twice. The turn's cache is unusable afterwards."""
        if not hit.lent:
            return
        for i, leaf in enumerate(self.kv_leaves):
            c = kinds.get(hit.cache, leaf)
            for part, attr in enumerate(("keys", "values")):
                buffer = getattr(c, attr)
                for node in hit.lent:
                    kv = list(node.payload.kv[i])
                    kv[part] = kinds.take(buffer, node.start, node.depth)
                    node.payload.kv[i] = tuple(kv)
                mx.eval([n.payload.kv[i][part] for n in hit.lent])
                setattr(c, attr, None)
        hit.lent = []

    def _build(self, used: list[Node], length: int, expect: int, lent: list[Node]) -> list[Any]:
        cache = self._make_cache()
        if length == 0:
            return cache
        for i, leaf in enumerate(self.kv_leaves):
            c = kinds.get(cache, leaf)
            capacity = -(-max(expect, length) // c.step) * c.step if expect else length
            for part, attr in enumerate(("keys", "values")):
                pieces = []
                for node in used:
                    kv = node.payload.kv[i][part]
                    end = min(node.depth, length) - node.start
                    pieces.append(kv if end == len(node.key) else kinds.take(kv, 0, end))
                if capacity > length:
                    pieces.append(kinds.zeros_like(pieces[0], capacity - length))
                setattr(c, attr, kinds.concat(pieces))
                del pieces
                mx.eval(getattr(c, attr))
                for node in lent:  # one layer's keys or values at a time: held once
                    kv = list(node.payload.kv[i])
                    kv[part] = None
                    node.payload.kv[i] = tuple(kv)
            c.offset = length
        for i, leaf in enumerate(self.window_leaves):
            parts: list[tuple[int, Any]] = []
            for a, b in spans.window_needs(length, *leaf.cls[1:]):
                for node in used:
                    p: Payload = node.payload
                    for (x, y), kv in zip(p.spans[leaf.cls], p.windows[i], strict=True):
                        lo, hi = max(a, x), min(b, y)
                        if lo < hi:
                            parts.append((lo, kinds.window_slice(kv, [(x, y)], lo, hi)))
            parts.sort(key=lambda part: part[0])
            kinds.build_window(kinds.get(cache, leaf), [kv for _, kv in parts], length)
        end = next((n for n in used if n.depth == length), None)
        for i, leaf in enumerate(self.state_leaves):
            kinds.put(cache, leaf, kinds.snapshot(end.payload.states[i]))
        mx.eval([kinds.arrays(c.state) for c in cache])
        return cache

    # -- insert -----------------------------------------------------------------

    def insert(
        self,
        tokens: Sequence[int],
        cache: list[Any],
        session: str = "",
        length: int | None = None,
    ) -> tuple[list[Node], list[Node]]:
        """Store the first `length` tokens of `tokens` (default: what `cache` has run).

        `cache` must have run exactly `length` tokens. Returns (added nodes, changed
        nodes: cut by a split, or given window slices or a state). Only what the tree
        does not hold yet is copied, so shared prefixes stay single copies.
        """
        held = cache_length(cache) if length is None else length
        tokens = list(tokens[:held])
        if not tokens:
            return [], []
        live = _Live(self, cache, held)
        if self.tier is not None:  # disk tier: on-disk nodes this turn runs through
            self.tier.before_insert(self.tree.match(tokens).path, tokens, live.payload)
        before = {n: (self.counts(n), self.entry_bytes(n)) for n in self.tree.match(tokens).path}
        added, split = self.tree.insert(tokens, live.payload, self._split, session=session)
        path = self.tree.match(tokens).path
        changed = list(split)
        for node in path:
            if live.fill(node, end=node is path[-1]) and node not in added and node not in changed:
                changed.append(node)
        for node in {*before, *path}:
            old_counts, old_bytes = before.get(node, ({}, 0))
            self._account(self.counts(node), node.payload.nbytes, old_counts, old_bytes)
            self.tree.resize(node)  # payloads changed in place
        return added, changed

    def _split(self, payload: Payload, k: int) -> tuple[Payload, Payload]:
        cut = payload.start + k
        head, tail = Payload(start=payload.start), Payload(start=cut)
        for kv in payload.kv:
            head.kv.append(kinds.take(kv, 0, k))
            tail.kv.append(kinds.take(kv, k, None))
        for c, held in payload.spans.items():
            head.spans[c] = spans.clip(held, payload.start, cut)
            tail.spans[c] = spans.clip(held, cut, payload.start + 10**12)
        for i, leaf in enumerate(self.window_leaves):
            held = payload.spans[leaf.cls]
            head.windows.append(_slices(payload.windows[i], held, head.spans[leaf.cls]))
            tail.windows.append(_slices(payload.windows[i], held, tail.spans[leaf.cls]))
        # A state is the cache at the end of the edge, so it stays with the lower part.
        tail.state, tail.states = payload.state, payload.states
        mx.eval(head.kv, tail.kv, head.windows, tail.windows)
        head.nbytes, tail.nbytes = _payload_bytes(head), _payload_bytes(tail)
        return head, tail

    # -- eviction and accounting ------------------------------------------------

    def _account(
        self,
        new_counts: dict[StorageClass, int],
        new_bytes: int,
        old_counts: dict[StorageClass, int],
        old_bytes: int,
    ) -> None:
        for c in self.classes:
            self.totals[c] += new_counts.get(c, 0) - old_counts.get(c, 0)
        self._bytes += new_bytes - old_bytes

    def evict(self, node: Node) -> int:
        """Drop an unlocked leaf and its payload; returns the bytes freed on this rank."""
        freed = self.entry_bytes(node)
        counts = self.counts(node)
        self.tree.remove_leaf(node)
        self._account({}, 0, counts, freed)
        node.payload = None
        return freed

    # -- the disk tier (exokv.cache.disk_tier) moves payloads between RAM and disk ------------

    def detach(self, node: Node) -> None:
        """`node`'s arrays leave RAM (the tier has them); its record stays in the tree."""
        p: Payload = node.payload
        self._account({}, 0, self.counts(node), p.nbytes)
        p.kv, p.windows, p.states, p.nbytes, p.tier = [], [], [], 0, "disk"
        self.tree.resize(node)  # its bytes and tier are reported with the turn's entries

    def attach(self, node: Node, payload: Payload) -> None:
        """`node` is back in RAM with `payload`."""
        payload.tier = "ram"
        node.payload = payload  # after the tier is set: the tree re-reads both
        self._account(self.counts(node), payload.nbytes, {}, 0)

    def cut(self, node: Node, k: int) -> Node:
        """Split `node` after k tokens, keeping its id on the tail; returns the head."""
        old = self.counts(node), self.entry_bytes(node)
        head = self.tree.split(node, k, self._split)
        _drop(self, head)
        self._account(self.counts(head), head.payload.nbytes, {}, 0)
        self._account(self.counts(node), node.payload.nbytes, *old)
        self.tree.resize(head)
        self.tree.resize(node)
        return head

    def clear(self) -> None:
        """Drop every entry. The same tree goes on, so its id counter does: a new
        entry never reuses the id of a cleared one (ids key the run's entry log)."""
        if self.tier is not None:
            self.tier.clear()
        self.tree.clear()
        self.totals = dict.fromkeys(self.classes, 0)
        self._bytes = 0


class _Live:
    """The cache a turn ran, by token position: where insert copies from."""

    def __init__(self, pc: PrefixCache, cache: list[Any], length: int) -> None:
        self.pc, self.cache, self.length = pc, cache, length
        self.windows = [kinds.window_positions(kinds.get(cache, w)) for w in pc.window_leaves]

    def payload(self, start: int, end: int) -> Payload:
        p = Payload(start=start)
        p.kv = [
            kinds.take((c.keys, c.values), start, end)
            for c in (kinds.get(self.cache, leaf) for leaf in self.pc.kv_leaves)
        ]
        p.spans = {c: [] for c in self.pc.window_classes}
        p.windows = [[] for _ in self.pc.window_leaves]
        mx.eval(p.kv)
        p.nbytes = _payload_bytes(p)
        return p

    def fill(self, node: Node, end: bool) -> bool:
        """Give `node` the window slices a fetch at this insert's end needs, drop those
        nothing can need any more, and (at the end) a state. Returns whether it changed."""
        p: Payload = node.payload
        changed = False
        for c in self.pc.window_classes:
            new: list[spans.Span] = []
            for a, b in spans.window_needs(self.length, *c[1:]):
                new += spans.missing(p.spans[c], max(a, node.start), min(b, node.depth))
            if not new:
                continue
            for i, leaf in enumerate(self.pc.window_leaves):
                if leaf.cls == c:
                    kv, held = self.windows[i]
                    pairs = list(zip(p.spans[c], p.windows[i], strict=True))
                    pairs += [((x, y), kinds.window_slice(kv, held, x, y)) for x, y in new]
                    p.windows[i] = [w for _, w in sorted(pairs, key=lambda pair: pair[0])]
            p.spans[c] = sorted([*p.spans[c], *new])
            changed = True
        changed |= _drop(self.pc, node)
        if end and STATE in self.pc.classes and not p.state:
            p.state = True
            p.states = [kinds.snapshot(kinds.get(self.cache, s)) for s in self.pc.state_leaves]
            changed = True
        if changed:
            mx.eval(p.windows, [kinds.arrays(s.state) for s in p.states])
            p.nbytes = _payload_bytes(p)
        return changed


def _drop(pc: PrefixCache, node: Node) -> bool:
    """Drop window slices no fetch at or below this node's end can need."""
    p: Payload = node.payload
    changed = False
    for c in pc.window_classes:
        keep = spans.keep_for_end(p.spans[c], node.depth, *c[1:])
        if keep == p.spans[c]:
            continue
        for i, leaf in enumerate(pc.window_leaves):
            if leaf.cls == c:
                p.windows[i] = _slices(p.windows[i], p.spans[c], keep)
        p.spans[c] = keep
        changed = True
    if changed:
        mx.eval(p.windows)
        p.nbytes = _payload_bytes(p)
    return changed


def _slices(arrays: list[Any], held: list[spans.Span], want: list[spans.Span]) -> list[Any]:
    """The slices for `want` (each inside one held span) out of `arrays` parallel to `held`."""
    out = []
    for a, b in want:
        for (x, y), kv in zip(held, arrays, strict=True):
            if x <= a and b <= y:
                out.append(kv if (a, b) == (x, y) else kinds.window_slice(kv, [(x, y)], a, b))
                break
        else:
            raise ValueError(f"positions {a}-{b} are not held")
    return out


def _payload_bytes(p: Payload) -> int:
    return kinds.nbytes([p.kv, p.windows, [kinds.arrays(s.state) for s in p.states]])


def _payload_size(p: Payload | None) -> int:
    return p.nbytes if p is not None else 0


def _in_ram(p: Payload | None) -> bool:
    return p is None or p.tier == "ram"
