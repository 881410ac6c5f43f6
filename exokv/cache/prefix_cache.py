"""Binds radix-tree nodes to mlx-lm cache objects: fetch a prefix, insert a turn, evict.

Two storage modes, chosen from the model's own cache type:
- slices: every layer is a KVCache or QuantizedKVCache (trimmable). Each node owns
  its own copy of the K/V of exactly its edge's tokens, so a shared prefix is
  held once; a fetch concatenates the slices along the path.
- snapshots: anything else (RotatingKVCache, ArraysCache, CacheList, mixed). Such
  caches cannot be cut at an arbitrary token, so whole-cache snapshots are kept
  at turn boundaries and a hit falls back to the nearest one at or below the match.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models.cache import (
    KVCache,
    QuantizedKVCache,
    can_trim_prompt_cache,
    trim_prompt_cache,
)

from exokv.cache.radix import Node, RadixTree

SEQ_AXIS = 2  # caches are (batch, kv heads, tokens, head dim)


@dataclass
class Payload:
    data: Any
    nbytes: int


@dataclass
class Hit:
    """A fetched prefix: a fresh cache holding `length` tokens, and the nodes it came from."""

    cache: list[Any]
    length: int
    path: list[Node]

    @property
    def entry(self) -> Node | None:
        return self.path[-1] if self.path else None


def cache_length(cache: Sequence[Any]) -> int:
    return max((int(getattr(c, "offset", 0)) for c in cache), default=0)


def _nbytes(tree: Any) -> int:
    return sum(a.nbytes for _, a in tree_flatten(tree) if isinstance(a, mx.array))


def _own(x: mx.array) -> mx.array:
    # A slice is a view that keeps its whole parent buffer alive; a copy frees it.
    return mx.array(x)


def _take(layer_kv: Any, start: int, end: int) -> Any:
    return tree_map(lambda a: _own(a[:, :, start:end, :]), layer_kv)


class PrefixCache:
    def __init__(self, make_cache: Callable[[], list[Any]]) -> None:
        self._make_cache = make_cache
        template = make_cache()
        self.mode = (
            "slices"
            if template and all(type(c) in (KVCache, QuantizedKVCache) for c in template)
            else "snapshots"
        )
        self.tree = RadixTree()

    # -- lookup -----------------------------------------------------------------

    def fetch(self, tokens: Sequence[int]) -> Hit:
        """The longest cached prefix of `tokens`, leaving at least one token to run.

        The returned cache is a fresh object: running the model on it never
        changes what the tree stores. The path is locked until `release`.
        """
        match = self.tree.match(tokens)
        limit = min(match.length, len(tokens) - 1)
        if self.mode == "slices":
            hit = self._fetch_slices(match.path, limit)
        else:
            hit = self._fetch_snapshot(match.path, limit)
        if hit.length > 0:
            self.tree.touch(hit.path)
            for node in hit.path:
                node.hits += 1
        self.tree.lock(hit.path)
        return hit

    def release(self, hit: Hit) -> None:
        self.tree.unlock(hit.path)

    def _fetch_slices(self, path: list[Node], limit: int) -> Hit:
        used = [n for n in path if n.start < limit]
        if not used:
            return Hit(cache=self._make_cache(), length=0, path=[])
        cache = self._make_cache()
        for layer, c in enumerate(cache):
            pieces = []
            for node in used:
                kv = node.payload.data[layer]
                end = min(node.depth, limit) - node.start
                if end < len(node.key):
                    kv = tree_map(lambda a, e=end: a[:, :, :e, :], kv)
                pieces.append(kv)
            keys = _concat([p[0] for p in pieces])
            values = _concat([p[1] for p in pieces])
            c.keys, c.values, c.offset = keys, values, limit
        mx.eval([(c.keys, c.values) for c in cache])
        return Hit(cache=cache, length=limit, path=used)

    def _fetch_snapshot(self, path: list[Node], limit: int) -> Hit:
        best: tuple[Node, list[Any], int] | None = None
        for node in path:
            if node.payload is None:
                continue
            if node.depth <= limit:
                best = (node, node.payload.data, node.depth)
            elif can_trim_prompt_cache(node.payload.data) and limit > 0:
                best = (node, node.payload.data, limit)
                break
        if best is None:
            return Hit(cache=self._make_cache(), length=0, path=[])
        node, snapshot, length = best
        cache = copy.deepcopy(snapshot)
        extra = cache_length(cache) - length
        if extra > 0:
            trim_prompt_cache(cache, extra)
        used = path[: path.index(node) + 1]
        return Hit(cache=cache, length=length, path=used)

    # -- insert -----------------------------------------------------------------

    def insert(
        self, tokens: Sequence[int], cache: list[Any], session: str = ""
    ) -> tuple[list[Node], list[Node]]:
        """Store the first cache_length(cache) tokens of `tokens` held in `cache`.

        Returns (added nodes, split nodes). Only the tokens not already in the
        tree are copied, so shared prefixes stay single copies.
        """
        held = cache_length(cache)
        tokens = list(tokens[:held])
        if not tokens:
            return [], []
        if self.mode == "slices":

            def make(start: int, end: int) -> Payload:
                data = [_take((c.keys, c.values), start, end) for c in cache]
                mx.eval(data)
                return Payload(data, _nbytes(data))

            return self.tree.insert(tokens, make, self._split_slices, session=session)

        def snapshot(start: int, end: int) -> Payload:
            data = copy.deepcopy(cache)
            return Payload(data, sum(c.nbytes for c in data))

        added, was_split = self.tree.insert(tokens, snapshot, _split_snapshot, session=session)
        end_node = self.tree.match(tokens).path[-1]
        if end_node.payload is None:
            # The tokens ended on a boundary that held no snapshot yet (possibly the
            # head this very insert cut off, which is already listed as added).
            end_node.payload = snapshot(0, len(tokens))
            if end_node not in added:
                added.append(end_node)
        return added, was_split

    def _split_slices(self, payload: Payload, k: int) -> tuple[Payload, Payload]:
        head = [_take(kv, 0, k) for kv in payload.data]
        tail = [tree_map(lambda a: _own(a[:, :, k:, :]), kv) for kv in payload.data]
        mx.eval(head, tail)
        return Payload(head, _nbytes(head)), Payload(tail, _nbytes(tail))

    # -- eviction and accounting ------------------------------------------------

    def entry_bytes(self, node: Node) -> int:
        return node.payload.nbytes if node.payload is not None else 0

    def evict(self, node: Node) -> int:
        """Drop an unlocked leaf and its payload; returns the bytes freed on this rank."""
        freed = self.entry_bytes(node)
        self.tree.remove_leaf(node)
        node.payload = None
        return freed

    def clear(self) -> None:
        """Drop every entry. The same tree goes on, so its id counter does: a new
        entry never reuses the id of a cleared one (ids key the run's entry log)."""
        for node in list(self.tree.nodes()):
            node.payload = None
        self.tree.root.children.clear()

    @property
    def total_bytes(self) -> int:
        return sum(self.entry_bytes(n) for n in self.tree.nodes())


def _concat(parts: list[Any]) -> Any:
    if isinstance(parts[0], tuple):  # quantized: (weights, scales, biases)
        return tuple(_concat([p[i] for p in parts]) for i in range(len(parts[0])))
    if len(parts) == 1:
        return _own(parts[0])
    return mx.concatenate(parts, axis=SEQ_AXIS)


def _split_snapshot(payload: Payload | None, k: int) -> tuple[None, Payload | None]:
    # A snapshot is the cache at the end of its edge, so it stays with the lower part.
    return None, payload
