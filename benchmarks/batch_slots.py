"""What a request that ends and one that joins cost a running batch's KV cache.

    python benchmarks/batch_slots.py                    # builtin:base's shape, 16,32,64 rows
    python benchmarks/batch_slots.py --rows 64 --tokens 760 --repeats 9

Before exokv.rank.slots, a row that ended was taken out of mlx-lm's `BatchKVCache`
with `filter` (every other row's K/V gathered into a new array) and a newcomer added
with `extend` (every row padded and concatenated again). Now the newcomer is written
into the ended row's slot (`slots.place`). For each batch size, on a batch of random
K/V shaped like builtin:base's (4 layers, 2 KV heads of 48, float32), the median
time of: a filter dropping one row, an extend adding one row, and a place into a
slot, each evaluated.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

from exokv.rank import slots


def batch_of(rows: int, tokens: int, layers: int, heads: int, dim: int) -> list[Any]:
    out = []
    for _ in range(layers):
        cache = BatchKVCache([0] * rows)
        shape = (rows, heads, tokens, dim)
        cache.update_and_fetch(mx.random.normal(shape), mx.random.normal(shape))
        out.append(cache)
    mx.eval([c.keys for c in out] + [c.values for c in out])
    return out


def own_of(tokens: int, layers: int, heads: int, dim: int) -> list[Any]:
    out = []
    for _ in range(layers):
        cache = KVCache()
        shape = (1, heads, tokens, dim)
        cache.update_and_fetch(mx.random.normal(shape), mx.random.normal(shape))
        out.append(cache)
    mx.eval([c.keys for c in out])
    return out


def drop(layers: list[Any], keep: mx.array) -> None:
    for c in layers:
        c.filter(keep)


def add(layers: list[Any], merged: list[Any]) -> None:
    for c, mine in zip(layers, merged, strict=True):
        c.extend(mine)


def timed(layers: list[Any], change: Any, *args: Any) -> float:
    """`change(layers, *args)` and its evaluation, in seconds."""
    tic = time.perf_counter()
    change(layers, *args)
    mx.eval([c.keys for c in layers] + [c.values for c in layers])
    return time.perf_counter() - tic


def measure(rows: int, args: argparse.Namespace) -> dict[str, float]:
    shape = (args.layers, args.heads, args.dim)
    times: dict[str, list[float]] = {"filter_ms": [], "extend_ms": [], "place_ms": []}
    for _ in range(args.repeats):
        batch = batch_of(rows, args.tokens, *shape)
        newcomer = own_of(args.newcomer_tokens, *shape)
        times["filter_ms"].append(timed(batch, drop, mx.array(list(range(1, rows)))))
        merged = [BatchKVCache.merge([c]) for c in newcomer]
        times["extend_ms"].append(timed(batch, add, merged))
        batch = batch_of(rows, args.tokens, *shape)
        times["place_ms"].append(timed(batch, slots.place, 0, newcomer))
    return {k: 1000 * statistics.median(v) for k, v in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--rows", default="16,32,64", help="batch sizes, a comma list")
    p.add_argument("--tokens", type=int, default=760, help="the batch's length")
    p.add_argument("--newcomer-tokens", type=int, default=520)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--dim", type=int, default=48)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    try:
        sizes = [int(x) for x in args.rows.split(",")]
    except ValueError:
        p.error(f"--rows {args.rows}: a comma list of whole numbers")
    if min(sizes) < 2 or min(args.tokens, args.layers, args.heads, args.dim, args.repeats) < 1:
        p.error("--rows at least 2; --tokens, --layers, --heads, --dim, --repeats at least 1")
    if not 0 < args.newcomer_tokens <= args.tokens:
        p.error(f"--newcomer-tokens {args.newcomer_tokens}: 1 to --tokens ({args.tokens})")
    results = {str(n): measure(n, args) for n in sizes}
    if args.json:
        print(json.dumps({"args": vars(args), "results": results}, indent=2))
        return
    print(f"{'rows':>5} {'filter':>10} {'extend':>10} {'place':>10}")
    for n, r in results.items():
        print(f"{n:>5} {r['filter_ms']:>8.1f}ms {r['extend_ms']:>8.1f}ms {r['place_ms']:>8.1f}ms")


if __name__ == "__main__":
    main()
