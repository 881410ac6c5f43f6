"""Speculative decoding (issue 33): decode tokens/s with drafts against --no-speculate.

    python benchmarks/speculate.py --model smollm2 --max-tokens 64 --repeat 3

One run, side by side, on one rank (the engine in this process) and on two pipeline
ranks (started first; they wait asleep between turns). Three cases at temperature 0:
- repeat: "Repeat this text exactly, word for word: ..." (a ~60-token passage): the
  reply is drafted by prompt lookup from the conversation;
- retry: the free answer's conversation sent again (what /retry sends) after its reply
  is in the cache: the reply is drafted from the prefix tree;
- free: a free answer, drafted only where it happens to repeat the prompt: what failed
  drafts cost.
Each repeat runs every (case, layout) with and without speculation, alternating which
goes first. repeat and free run without the cache (each run alike); retry with it. The
replies must be the same with and without speculation. Medians; the acceptance rate
is accepted draft tokens over draft tokens. Prints a table, or with --json one document.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from typing import Any

from bench_common import pipeline_client

from exokv.core.records import TurnRequest, TurnResult
from exokv.model.resolve import load_model
from exokv.rank.engine import Engine, EngineOptions

PASSAGE = (
    "The old lighthouse keeper climbed the spiral stairs every evening at dusk, carrying "
    "a lantern and a small notebook. He wrote down the color of the sky, the direction of "
    "the wind, and the names of the ships that passed. After forty years, his notebooks "
    "filled an entire shelf."
)
CASES = {
    "repeat": f"Repeat this text exactly, word for word: {PASSAGE}",
    "retry": "Write a long story about a dragon who learns to bake bread.",
    "free": "Write a long story about a dragon who learns to bake bread.",
}


def request(case: str, max_tokens: int, speculate: bool) -> TurnRequest:
    messages = [{"role": "user", "content": CASES[case]}]
    return TurnRequest(
        f"bench-{case}",
        messages,
        max_tokens=max_tokens,
        use_cache=case == "retry",
        speculate=speculate,
    )


def one(turn: Callable[[TurnRequest], TurnResult], req: TurnRequest) -> dict[str, Any]:
    r = turn(req)
    return {
        "decode_tps": r.decode_tps,
        "tokens": r.generated_tokens,
        "draft_tokens": r.draft_tokens,
        "accepted_tokens": r.accepted_tokens,
        "reply": r.reply,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    model, tokenizer = load_model(args.model)
    engine = Engine(model, tokenizer, options=EngineOptions())
    client = pipeline_client(args.model, args.max_tokens, args.starting_port)
    layouts: dict[str, Callable[[TurnRequest], TurnResult]] = {
        "1 rank": engine.turn,
        "2 ranks": client.turn,
    }
    runs: dict[str, list[dict[str, Any]]] = {}
    try:
        for turn in layouts.values():  # the reply /retry regenerates, in each cache
            turn(request("retry", args.max_tokens, speculate=False))
        for i in range(args.repeat):
            for case in args.cases:
                for layout, turn in layouts.items():
                    modes = [True, False] if i % 2 == 0 else [False, True]
                    for speculate in modes:
                        key = f"{case}|{layout}|{'speculate' if speculate else 'plain'}"
                        got = one(turn, request(case, args.max_tokens, speculate))
                        runs.setdefault(key, []).append(got)
                        figures = {k: v for k, v in got.items() if k != "reply"}
                        print(key, json.dumps(figures), file=sys.stderr, flush=True)
    finally:
        client.close()
    rows = []
    for case in args.cases:
        for layout in layouts:
            spec = runs[f"{case}|{layout}|speculate"]
            plain = runs[f"{case}|{layout}|plain"]
            drafted = sum(r["draft_tokens"] for r in spec)
            accepted = sum(r["accepted_tokens"] for r in spec)
            s = statistics.median(r["decode_tps"] for r in spec)
            p = statistics.median(r["decode_tps"] for r in plain)
            rows.append(
                {
                    "case": case,
                    "layout": layout,
                    "tokens": spec[0]["tokens"],
                    "plain_tps": p,
                    "speculate_tps": s,
                    "speedup": s / p if p else None,
                    "acceptance": accepted / drafted if drafted else None,
                    "draft_tokens": drafted / len(spec),
                    "same_reply": len({r["reply"] for r in spec + plain}) == 1,
                    "plain_runs": [round(r["decode_tps"], 2) for r in plain],
                    "speculate_runs": [round(r["decode_tps"], 2) for r in spec],
                }
            )
    return {
        "model": args.model,
        "max_tokens": args.max_tokens,
        "repeat": args.repeat,
        "rows": rows,
        "runs": runs,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--cases", default=",".join(CASES), help="comma separated: repeat,retry,free")
    p.add_argument("--starting-port", type=int, default=26160)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    args.cases = [c for c in args.cases.split(",") if c]
    unknown = [c for c in args.cases if c not in CASES]
    if unknown:
        p.error(f"unknown case {unknown[0]!r}: use {', '.join(CASES)}")
    doc = run(args)
    if args.json:
        print(json.dumps(doc, indent=1))
        return
    print(f"{doc['model']}, --max-tokens {doc['max_tokens']}, medians of {doc['repeat']}")
    print("| case | layout | tokens | plain tok/s | speculate tok/s | speedup | accepted | same |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |")
    for r in doc["rows"]:
        acc = "-" if r["acceptance"] is None else f"{100 * r['acceptance']:.0f}%"
        speed = "-" if r["speedup"] is None else f"{r['speedup']:.2f}x"
        print(
            f"| {r['case']} | {r['layout']} | {r['tokens']} | {r['plain_tps']:.2f} | "
            f"{r['speculate_tps']:.2f} | {speed} | {acc} | {r['same_reply']} |"
        )


if __name__ == "__main__":
    main()
