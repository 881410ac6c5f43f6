"""How each layer of a model's cache is stored, decided from the model's own make_cache.

Every layer (every sub-cache of a CacheList) is one of three storage kinds:
- "kv": KVCache / QuantizedKVCache. Every token's K/V is kept: per-token slices.
- "window": RotatingKVCache (sliding window, and every layer under --max-kv-size).
  Per-token slices too, but only of the positions a rotating cache still holds
  (the `keep` first tokens and the last window), so a fetch can rebuild it.
- "state": anything else (ArraysCache: linear-attention / SSM conv and recurrent
  state). A copy of the layer's whole cache where a turn reached a node's end.

A storage class is what the tree counts: "kv", ("window", size, keep) or "state".
Every layer of a class stores the same token positions (or states), so a rank's
bytes are the tree's counts per class times that rank's bytes per unit of it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models.cache import CacheList, KVCache, QuantizedKVCache, RotatingKVCache

from exokv.cache.spans import Span

SEQ_AXIS = 2  # caches are (batch, kv heads, tokens, head dim)
KV = ("kv", 0, 0)
STATE = ("state", 0, 0)
StorageClass = tuple[str, int, int]  # (kind, window, keep); window/keep only for "window"


@dataclass(frozen=True)
class Leaf:
    """One layer cache (or one sub-cache of a CacheList) and how it is stored."""

    layer: int
    sub: int | None  # index inside a CacheList, else None
    cls: StorageClass


def storage_class(c: Any) -> StorageClass:
    if type(c) in (KVCache, QuantizedKVCache):
        return KV
    if type(c) is RotatingKVCache:
        return ("window", int(c.max_size), int(c.keep))
    return STATE


def leaves(cache: Sequence[Any]) -> list[Leaf]:
    out = []
    for i, c in enumerate(cache):
        if isinstance(c, CacheList):
            out += [Leaf(i, j, storage_class(s)) for j, s in enumerate(c.caches)]
        else:
            out.append(Leaf(i, None, storage_class(c)))
    return out


def get(cache: Sequence[Any], leaf: Leaf) -> Any:
    c = cache[leaf.layer]
    return c if leaf.sub is None else c.caches[leaf.sub]


def put(cache: list[Any], leaf: Leaf, value: Any) -> None:
    if leaf.sub is None:
        cache[leaf.layer] = value
    else:
        subs = list(cache[leaf.layer].caches)
        subs[leaf.sub] = value
        cache[leaf.layer].caches = tuple(subs)


def offset(cache: Sequence[Any]) -> int:
    """Tokens the cache has run (its deepest layer's offset; states have none)."""
    cs = [get(cache, leaf) for leaf in leaves(cache)]
    return max((int(getattr(c, "offset", 0)) for c in cs), default=0)


def nbytes(tree: Any) -> int:
    return sum(a.nbytes for a in arrays(tree))


def own(x: mx.array) -> mx.array:
    # A slice is a view that keeps its whole parent buffer alive; a copy frees it.
    return mx.array(x)


def take(kv: Any, start: int, end: int | None) -> Any:
    """An owned copy of tokens [start, end) of (keys, values)."""
    return tree_map(lambda a: own(a[:, :, start:end, :]), kv)


def concat(parts: list[Any]) -> Any:
    # Quantized: (weights, scales, biases); a list once a pipeline stage has made the
    # cache depend on its send (mx.depends returns one), as mlx-lm's own pipelines do.
    if isinstance(parts[0], (tuple, list)):
        return tuple(concat([p[i] for p in parts]) for i in range(len(parts[0])))
    if len(parts) == 1:
        return own(parts[0])
    return mx.concatenate(parts, axis=SEQ_AXIS)


def zeros_like(kv: Any, tokens: int) -> Any:
    """Zeros shaped like `kv` (an array, or quantized parts) but `tokens` long."""
    return tree_map(
        lambda a: mx.zeros((*a.shape[:SEQ_AXIS], tokens, *a.shape[SEQ_AXIS + 1 :]), a.dtype), kv
    )


# -- a rotating cache's tokens by position -------------------------------------------


def window_positions(c: RotatingKVCache) -> tuple[Any, list[Span]]:
    """The (keys, values) a rotating cache holds in temporal order, and their positions."""
    if c.keys is None:
        return None, []
    keys, values = c._temporal_order(c.keys), c._temporal_order(c.values)
    held, n = int(keys.shape[SEQ_AXIS]), int(c.offset)
    if held >= n:
        return (keys[:, :, :n, :], values[:, :, :n, :]), [(0, n)]
    keep = int(c.keep)
    return (keys, values), [(0, keep), (n - (held - keep), n)] if keep else [(n - held, n)]


def window_slice(kv: Any, held: list[Span], start: int, end: int) -> Any:
    """An owned copy of positions [start, end) out of (keys, values) holding `held`."""
    index = 0
    for a, b in held:
        if a <= start and end <= b:
            return take(kv, index + start - a, index + end - a)
        index += b - a
    raise ValueError(f"positions {start}-{end} are not held")


def build_window(fresh: RotatingKVCache, parts: list[Any], length: int) -> RotatingKVCache:
    """A rotating cache that has run `length` tokens, from its held positions in order."""
    if parts:
        fresh.keys = concat([p[0] for p in parts])
        fresh.values = concat([p[1] for p in parts])
        fresh._idx = int(fresh.keys.shape[SEQ_AXIS])
    fresh.offset = length
    return fresh


def snapshot(c: Any) -> Any:
    """A copy of a state layer that later runs of the live cache cannot change, owning
    its arrays (a state is often a slice of a larger buffer, which it would keep alive)."""
    out = copy.copy(c)
    try:
        out.state = tree_map(lambda a: own(a) if isinstance(a, mx.array) else a, c.state)
    except (AttributeError, TypeError, ValueError):
        return copy.deepcopy(c)
    return out


# -- bytes per unit of each storage class, measured on this rank ----------------------


def measure_rates(
    make_cache: Callable[[], list[Any]], run: Callable[[list[Any]], None]
) -> dict[StorageClass, int]:
    """Bytes one token (kv, window) or one state adds on this rank, per class.

    `run(cache)` runs one token through the model (on every rank alike: a pipeline
    forward is itself collective).
    """
    cache = make_cache()
    run(cache)
    rates: dict[StorageClass, int] = {}
    for leaf in leaves(cache):
        c = get(cache, leaf)
        if leaf.cls[0] == "state":
            size = nbytes(c.state)
        else:
            # Buffers are (batch, heads, capacity, dim): bytes per unit of capacity.
            arrays = [a for _, a in tree_flatten((c.keys, c.values))]
            size = sum(a.nbytes // max(a.shape[SEQ_AXIS], 1) for a in arrays)
        rates[leaf.cls] = rates.get(leaf.cls, 0) + int(size)
    return rates


def arrays(tree: Any) -> list[mx.array]:
    """The arrays in a cache's state (which also holds ints, names and None)."""
    return [a for _, a in tree_flatten(tree) if isinstance(a, mx.array)]
