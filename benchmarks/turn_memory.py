"""Peak MLX memory of a cached turn, over the bytes the cache holds, per strategy.

One conversation: a long first prompt (about --context tokens), then a short
follow-up; the follow-up is measured. Peak is mx.get_peak_memory() during that
turn minus everything held before it but the cache (weights, ...), so it is the
cache plus what the turn holds; divided by the cache's bytes before the turn.

    EXOKV_HOME=$(mktemp -d) python benchmarks/turn_memory.py --model builtin:small --context 8000
"""

from __future__ import annotations

import argparse
import gc

import mlx.core as mx

from exokv.bench.strategies import Carried, MlxLmLru
from exokv.core.records import TurnRequest
from exokv.model.resolve import load_model
from exokv.rank.engine import Engine


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="builtin:small")
    parser.add_argument("--context", type=int, default=8000)
    parser.add_argument("--reply-tokens", type=int, default=32)
    args = parser.parse_args()
    model, tokenizer = load_model(args.model)
    words = " ".join(f"stone {i} river light" for i in range(args.context // 9))
    first = [{"role": "user", "content": words}]
    n = args.reply_tokens

    engine = Engine(model, tokenizer)
    r1 = engine.turn(TurnRequest("s", first, max_tokens=n))
    second = first + [
        {"role": "assistant", "content": r1.reply},
        {"role": "user", "content": "Why?"},
    ]
    rows = []

    def measure(name, turn, held):
        gc.collect()
        mx.clear_cache()
        before = held()
        base = mx.get_active_memory() - before
        mx.reset_peak_memory()
        turn()
        peak = mx.get_peak_memory() - base
        rows.append((name, before, peak))

    measure(
        "exokv",
        lambda: engine.turn(TurnRequest("s", second, max_tokens=n)),
        lambda: engine.cache.total_bytes,
    )
    for cls in (Carried, MlxLmLru):
        strategy = cls(model, tokenizer, render_fn=engine.render)
        strategy.turn("s", first, n)
        measure(cls.name, lambda s=strategy: s.turn("s", second, n), strategy.cache_bytes)
    print(f"{args.model}, {r1.prompt_tokens + r1.generated_tokens} tokens cached, follow-up turn:")
    print(f"{'strategy':12s} {'cache bytes':>12s} {'peak bytes':>12s} {'peak/cache':>10s}")
    for name, held, peak in rows:
        print(f"{name:12s} {held:12d} {peak:12d} {peak / held:10.2f}")


if __name__ == "__main__":
    main()
