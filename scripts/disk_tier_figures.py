"""Load time of a disk-tier hit per token against prefill time per token, on this machine.

    python scripts/disk_tier_figures.py [--model builtin:base] [--tokens 2000] [--repeat 3]

One process, one rank: a prompt of --tokens tokens is prefilled into a fresh cache
(timed), then stored in the prefix cache, spilled to the disk tier (every write
done), and fetched back (timed: read, checksum, decode and rebuild of the cache).
Medians of --repeat. The files are in the OS page cache (just written), so this is
the warm-file figure; a cold SSD adds its read time (bytes / read bandwidth).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import mlx.core as mx

from exokv.model.resolve import load_model
from exokv.rank.engine import Engine, EngineOptions, prefill


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="builtin:base")
    p.add_argument("--tokens", type=int, default=2000)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--kv-bits", type=int, default=None)
    p.add_argument("--kv-group-size", type=int, default=64)
    args = p.parse_args()
    model, tokenizer = load_model(args.model)
    options = EngineOptions(
        disk_dir=tempfile.mkdtemp(prefix="exokv-figures-"),
        disk_budget=1 << 40,
        kv_bits=args.kv_bits,
        kv_group_size=args.kv_group_size,
    )
    engine = Engine(model, tokenizer, options=options)
    tier = engine.coord.tier
    vocab = int(tokenizer.vocab_size) if hasattr(tokenizer, "vocab_size") else 256
    tokens = [1 + (i * 7919) % (vocab - 2) for i in range(args.tokens)]
    prefills, loads = [], []
    for _ in range(args.repeat):
        cache = engine._new_cache()
        tic = time.perf_counter()
        prefill(model, cache, tokens)
        prefills.append(time.perf_counter() - tic)
        engine.cache.clear()
        engine.cache.insert(tokens, cache)
        tier.close()  # spill every RAM entry, wait for the writes
        disk = sum(f.stat().st_size for f in tier.store.root.glob("*.kv"))
        tic = time.perf_counter()
        hit = engine.cache.fetch([*tokens, 0])
        mx.eval([c.state for c in hit.cache])
        loads.append(time.perf_counter() - tic)
        engine.cache.release(hit)
        assert hit.length == len(tokens), hit.length
    n = len(tokens)
    pre, load = statistics.median(prefills), statistics.median(loads)
    print(f"model {args.model}, {n} tokens, kv bits {args.kv_bits or 16}")
    print(f"bytes per token in RAM {engine.bytes_per_token}, on disk {disk / n:.0f}")
    print(f"prefill {1e6 * pre / n:.1f} us/token ({pre:.3f} s)")
    print(f"disk-tier load {1e6 * load / n:.1f} us/token ({load:.3f} s)")
    print(f"prefill / load = {pre / load:.1f}x")


if __name__ == "__main__":
    main()
