"""TTFT per turn with the prefix cache vs --no-cache, and the cache's own overhead.

    python benchmarks/turns.py --model builtin:base --turns 8 --context 2000

Both engines run the same conversation, turn by turn, interleaved (cached turn,
then the same turn cold) so machine noise hits both alike. Prints a table and,
with --json, one JSON document.
"""

from __future__ import annotations

import argparse
import json
import statistics

from bench_common import user_text, words_per_turn

from exokv.core.records import TurnRequest
from exokv.model.resolve import load_model
from exokv.rank.engine import Engine, EngineOptions


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="builtin:base")
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--context", type=int, default=2000)
    ap.add_argument("--reply-tokens", type=int, default=32)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    model, tokenizer = load_model(args.model)
    cached = Engine(model, tokenizer, options=EngineOptions())
    cold = Engine(model, tokenizer, options=EngineOptions())
    words = words_per_turn(tokenizer, args.context, args.turns, args.reply_tokens)
    messages: list[dict[str, str]] = [{"role": "system", "content": "You are terse."}]
    rows = []
    for t in range(1, args.turns + 1):
        messages.append({"role": "user", "content": user_text(t, words)})
        req = TurnRequest(session="bench", messages=list(messages), max_tokens=args.reply_tokens)
        hot = cached.turn(req)
        base = cold.turn(TurnRequest(**{**req.to_dict(), "use_cache": False}))
        if hot.reply != base.reply:
            raise SystemExit(f"turn {t}: the cached reply differs from the cold one")
        messages.append({"role": "assistant", "content": hot.reply})
        rows.append(
            {
                "turn": t,
                "prompt_tokens": hot.prompt_tokens,
                "cached_tokens": hot.cached_tokens,
                "new_tokens": hot.prefilled_tokens,
                "ttft_cached_s": hot.ttft_s,
                "ttft_cold_s": base.ttft_s,
                "ratio": hot.ttft_s / base.ttft_s,
                "new_over_context": hot.prefilled_tokens / hot.prompt_tokens,
                "overhead_s": hot.overhead_s,
                "overhead_pct_of_ttft": 100 * hot.overhead_s / hot.ttft_s,
            }
        )
    summary = {
        "model": args.model,
        "turns": rows,
        "total_ttft_cached_s": sum(r["ttft_cached_s"] for r in rows),
        "total_ttft_cold_s": sum(r["ttft_cold_s"] for r in rows),
        "median_overhead_pct": statistics.median(r["overhead_pct_of_ttft"] for r in rows),
    }
    if args.json:
        print(json.dumps(summary, indent=2))
        return
    print(
        f"{'turn':>4} {'prompt':>6} {'cached':>6} {'new':>5} {'ttft cache':>10} "
        f"{'ttft cold':>9} {'ratio':>6} {'new/ctx':>7} {'overhead':>9}"
    )
    for r in rows:
        print(
            f"{r['turn']:>4} {r['prompt_tokens']:>6} {r['cached_tokens']:>6} {r['new_tokens']:>5} "
            f"{r['ttft_cached_s']:>9.3f}s {r['ttft_cold_s']:>8.3f}s {r['ratio']:>6.3f} "
            f"{r['new_over_context']:>7.3f} {r['overhead_s'] * 1000:>6.1f} ms "
            f"({r['overhead_pct_of_ttft']:.1f}%)"
        )
    print(
        f"total TTFT: cached {summary['total_ttft_cached_s']:.2f}s, "
        f"cold {summary['total_ttft_cold_s']:.2f}s; "
        f"median overhead {summary['median_overhead_pct']:.2f}% of TTFT"
    )


if __name__ == "__main__":
    main()
