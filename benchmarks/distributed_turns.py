"""TTFT per turn on -n 2 --parallel pipeline with and without the cache, and the
per-turn coordination overhead (the one collective and the eviction plan) on
-n 2 against one rank.

    python benchmarks/distributed_turns.py --model builtin:base --turns 8 --context 2000

The ranks are started once (mlx.launch, on this machine); each turn runs cached
and then the same turn with the cache off, on the same ranks, so machine noise
hits both alike, and the replies must match. Once the ranks are gone, a one-rank
engine replays the same conversation in this process for the overhead comparison. overhead_s is the
engine's: the lookup, the collective, the plan and the insert; the gather column
is the collective alone, from rank 0's own log. Prints a table, or with --json
one JSON document.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from typing import Any

from bench_common import user_text, words_per_turn

from exokv.client.cluster import ClusterClient
from exokv.config import exokv_home
from exokv.core.records import TurnRequest
from exokv.frontend.start import ChatOptions, validate
from exokv.model.resolve import load_model
from exokv.rank.engine import Engine, EngineOptions


def run(args: argparse.Namespace) -> dict[str, Any]:
    model, tokenizer = load_model(args.model)
    local = Engine(model, tokenizer, options=EngineOptions())
    words = words_per_turn(tokenizer, args.context, args.turns, args.reply_tokens)

    opts = ChatOptions(
        model=args.model,
        ranks=args.ranks,
        parallel=args.parallel,
        max_tokens=args.reply_tokens,
        starting_port=args.starting_port,
        seed=0,
    )
    # Each rank logs its turns (EXOKV_RANK_LOG), with the wall time of the gather.
    os.environ["EXOKV_RANK_LOG"] = "1"
    log = exokv_home() / "ranks" / "rank-0.jsonl"
    start = log.stat().st_size if log.exists() else 0
    client = ClusterClient(validate(opts))
    rows = []
    requests = []
    messages: list[dict[str, str]] = [{"role": "system", "content": "You are terse."}]
    try:
        for t in range(1, args.turns + 1):
            messages.append({"role": "user", "content": user_text(t, words)})
            req = TurnRequest("bench", list(messages), max_tokens=args.reply_tokens)
            hot = client.turn(req)
            cold = client.turn(TurnRequest(**{**req.to_dict(), "use_cache": False}))
            if hot.reply != cold.reply:
                raise SystemExit(f"turn {t}: the cached reply differs from the cold one")
            messages.append({"role": "assistant", "content": hot.reply})
            requests.append((req, hot.reply))
            rows.append(
                {
                    "turn": t,
                    "prompt_tokens": hot.prompt_tokens,
                    "cached_tokens": hot.cached_tokens,
                    "ttft_cached_s": hot.ttft_s,
                    "ttft_cold_s": cold.ttft_s,
                    "speedup": cold.ttft_s / hot.ttft_s,
                    "overhead_ranks_s": hot.overhead_s,
                }
            )
    finally:
        client.close()
    # One rank replays the conversation once the ranks are gone (no CPU shared with them).
    for row, (req, reply) in zip(rows, requests, strict=True):
        one = local.turn(req)
        if one.reply != reply:
            raise SystemExit(f"turn {row['turn']}: one rank replies differently")
        row["overhead_one_rank_s"] = one.overhead_s
        row["ttft_one_rank_s"] = one.ttft_s
    with open(log) as f:
        f.seek(start)
        logged = [json.loads(line) for line in f]
    for row, hot in zip(rows, logged[0::2], strict=True):  # cached turn, then the cold one
        row["gather_s"] = hot["gather_s"]
    return {
        "model": args.model,
        "ranks": args.ranks,
        "parallel": args.parallel,
        "turns": rows,
        "total_ttft_cached_s": sum(r["ttft_cached_s"] for r in rows),
        "total_ttft_cold_s": sum(r["ttft_cold_s"] for r in rows),
        "median_overhead_ranks_s": statistics.median(r["overhead_ranks_s"] for r in rows),
        "median_overhead_one_rank_s": statistics.median(r["overhead_one_rank_s"] for r in rows),
        "median_gather_s": statistics.median(r["gather_s"] for r in rows),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="builtin:base")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--parallel", default="pipeline", choices=("pipeline", "tensor"))
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--context", type=int, default=2000)
    ap.add_argument("--reply-tokens", type=int, default=32)
    ap.add_argument("--starting-port", type=int, default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    summary = run(args)
    if args.json:
        print(json.dumps(summary, indent=2))
        return
    n = args.ranks
    print(
        f"{'turn':>4} {'prompt':>6} {'cached':>6} {f'ttft -n {n}':>11} {'no cache':>9} "
        f"{'speedup':>7} {f'overhead -n {n}':>14} {'one rank':>9} {'gather':>8}"
    )
    for r in summary["turns"]:
        print(
            f"{r['turn']:>4} {r['prompt_tokens']:>6} {r['cached_tokens']:>6} "
            f"{r['ttft_cached_s']:>10.3f}s {r['ttft_cold_s']:>8.3f}s {r['speedup']:>6.2f}x "
            f"{r['overhead_ranks_s'] * 1000:>11.2f} ms {r['overhead_one_rank_s'] * 1000:>6.2f} ms "
            f"{r['gather_s'] * 1000:>5.2f} ms"
        )
    print(
        f"total TTFT on -n {n}: cached {summary['total_ttft_cached_s']:.2f}s, "
        f"no cache {summary['total_ttft_cold_s']:.2f}s; median coordination overhead "
        f"{summary['median_overhead_ranks_s'] * 1000:.2f} ms on -n {n}, "
        f"{summary['median_overhead_one_rank_s'] * 1000:.2f} ms on one rank "
        f"(of which the gather on -n {n}: {summary['median_gather_s'] * 1000:.2f} ms)"
    )


if __name__ == "__main__":
    main()
