"""Speculative decoding (issues 33, 46): decode tokens/s with drafts against --no-speculate.

    python benchmarks/speculate.py --model smollm2 --weights converted,float16 \
        --cases repeat,free --max-tokens 80 --repeat 3

One run, side by side, on one rank (the engine in this process) and on two pipeline
ranks (started first; they wait asleep between turns), for each of the model's
weights: `converted` (as exokv converted it: SmolLM2 is 4-bit) and `float16` (the
same model dequantized to float16 by mlx-lm's `convert --dequantize --dtype
float16`, made once under --float16-dir; see docs/models.md). Before the
turns, the cost of a k-token pass over a one-token pass on those weights (k tokens
through the model after a 128-token cache, medians of 3). Three cases at
temperature 0:
- repeat: "Repeat this text exactly, word for word: ..." (a ~60-word paragraph): the
  reply is drafted by prompt lookup from the conversation;
- retry: the free answer's conversation sent again (what /retry sends) after its reply
  is in the cache: the reply is drafted from the prefix tree;
- free: a free answer, drafted only where it happens to repeat the prompt: what failed
  drafts cost.
Each repeat runs every (case, layout) with and without speculation, alternating which
goes first. repeat and free run without the cache (each run alike); retry with it. The
replies must be the same with and without speculation. Medians; the acceptance rate
is accepted draft tokens over draft tokens; `why` sums the speculating turns' draft
decisions (speculation_detail.why). Prints tables, or with --json one document.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench_common import pipeline_client

from exokv.core.records import TurnRequest, TurnResult
from exokv.model.resolve import load_model, resolve_model
from exokv.rank.engine import Engine, EngineOptions

PASSAGE = (
    "The old lighthouse keeper climbed the spiral stairs every evening at dusk, carrying "
    "a lantern and a small notebook. He wrote down the color of the sky, the direction of "
    "the wind, and the names of the ships that passed. After forty years, his notebooks "
    "filled an entire shelf, and visitors who asked why he kept writing were always told "
    "that the sea deserved a witness."
)
CASES = {
    "repeat": f"Repeat this text exactly, word for word: {PASSAGE}",
    "retry": "Write a long story about a dragon who learns to bake bread.",
    "free": "Write a long story about a dragon who learns to bake bread.",
}
WEIGHTS = ("converted", "float16")
PASS_KS = (1, 2, 4, 8, 9, 16)


def float16_copy(model: str, under: Path) -> str:
    """The model's weights dequantized to float16, made once under `under`."""
    from mlx_lm.convert import convert  # deferred: only with --weights float16

    source = resolve_model(model)
    target = under / f"{source.name}-float16"
    if not (target / "config.json").exists():
        print(f"making {target} (mlx_lm convert --dequantize --dtype float16)", file=sys.stderr)
        convert(str(source), mlx_path=str(target), dequantize=True, dtype="float16")
    return str(target)


def pass_costs(model: Any, ks: tuple[int, ...] = PASS_KS, ctx: int = 128) -> dict[str, float]:
    """Seconds of k tokens through the model after `ctx` cached ones, medians of 3."""
    import mlx.core as mx  # deferred: the model is loaded already
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    model(mx.array([[1] * ctx]), cache=cache)
    mx.eval([c.state for c in cache])
    out = {}
    for k in ks:
        times = []
        mx.eval(model(mx.array([[2] * k]), cache=cache))  # a first pass of k is not timed
        for c in cache:
            c.trim(k)
        for _ in range(3):
            tic = time.perf_counter()
            mx.eval(model(mx.array([[2] * k]), cache=cache))
            times.append(time.perf_counter() - tic)
            for c in cache:
                c.trim(k)  # back to the `ctx` tokens
        out[str(k)] = statistics.median(times)
    return out


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
        "detail": r.speculation_detail,
        "reply": r.reply,
    }


def run_weights(args: argparse.Namespace, weights: str, port: int) -> dict[str, Any]:
    name = float16_copy(args.model, args.float16_dir) if weights == "float16" else args.model
    model, tokenizer = load_model(name)
    costs = pass_costs(model)
    print(weights, "pass cost", json.dumps(costs), file=sys.stderr, flush=True)
    engine = Engine(model, tokenizer, options=EngineOptions())
    layouts: dict[str, Callable[[TurnRequest], TurnResult]] = {"1 rank": engine.turn}
    client = pipeline_client(name, args.max_tokens, port) if args.ranks2 else None
    if client is not None:
        layouts["2 ranks"] = client.turn
    runs: dict[str, list[dict[str, Any]]] = {}
    try:
        if "retry" in args.cases:
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
                        figures = {k: v for k, v in got.items() if k not in ("reply", "detail")}
                        figures["why"] = got["detail"].get("why")
                        figures["reply_sha1"] = hashlib.sha1(got["reply"].encode()).hexdigest()[:10]
                        print(weights, key, json.dumps(figures), file=sys.stderr, flush=True)
    finally:
        if client is not None:
            client.close()
    return {"weights": weights, "model": name, "pass_cost_s": costs, "rows": rows(args, runs)}


def rows(args: argparse.Namespace, runs: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    out = []
    layouts = sorted({key.split("|")[1] for key in runs})
    for case in args.cases:
        for layout in layouts:
            spec = runs[f"{case}|{layout}|speculate"]
            plain = runs[f"{case}|{layout}|plain"]
            drafted = sum(r["draft_tokens"] for r in spec)
            accepted = sum(r["accepted_tokens"] for r in spec)
            s = statistics.median(r["decode_tps"] for r in spec)
            p = statistics.median(r["decode_tps"] for r in plain)
            why: Counter[str] = Counter()
            for r in spec:
                why.update(r["detail"].get("why", {}))
            out.append(
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
                    "why": dict(sorted(why.items())),
                    "plain_runs": [round(r["decode_tps"], 2) for r in plain],
                    "speculate_runs": [round(r["decode_tps"], 2) for r in spec],
                    "last_detail": spec[-1]["detail"],
                }
            )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--weights", default="converted", help="comma separated: converted,float16")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--cases", default=",".join(CASES), help="comma separated: repeat,retry,free")
    p.add_argument(
        "--float16-dir",
        type=Path,
        default=Path(tempfile.gettempdir()) / "exokv-bench",
        help="where the float16 copy is made once (default: %(default)s)",
    )
    p.add_argument("--one-rank-only", dest="ranks2", action="store_false")
    p.add_argument("--starting-port", type=int, default=26160)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    args.cases = [c for c in args.cases.split(",") if c]
    unknown = [c for c in args.cases if c not in CASES]
    if unknown:
        p.error(f"unknown case {unknown[0]!r}: use {', '.join(CASES)}")
    weights = [w for w in args.weights.split(",") if w]
    if any(w not in WEIGHTS for w in weights):
        p.error(f"--weights: use {', '.join(WEIGHTS)}")
    doc = {
        "model": args.model,
        "max_tokens": args.max_tokens,
        "repeat": args.repeat,
        "weights": [
            run_weights(args, w, args.starting_port + 20 * i) for i, w in enumerate(weights)
        ],
    }
    if args.json:
        print(json.dumps(doc, indent=1))
        return
    print_tables(doc)


def print_tables(doc: dict[str, Any]) -> None:
    print(f"{doc['model']}, --max-tokens {doc['max_tokens']}, medians of {doc['repeat']}")
    print("\n| weights | " + " | ".join(f"k={k}" for k in PASS_KS) + " |")
    print("| --- |" + " ---: |" * len(PASS_KS))
    for w in doc["weights"]:
        c = w["pass_cost_s"]
        one_ms = 1000 * c["1"]
        cells = [f"{one_ms:.0f} ms"] + [f"{c[str(k)] / c['1']:.1f}×" for k in PASS_KS[1:]]
        print(f"| {w['weights']} | " + " | ".join(cells) + " |")
    print(
        "\n| weights | case | layout | tokens | plain tok/s | speculate tok/s | speedup "
        "| accepted | drafted | same | why |"
    )
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |")
    for w in doc["weights"]:
        for r in w["rows"]:
            acc = "-" if r["acceptance"] is None else f"{100 * r['acceptance']:.0f}%"
            speed = "-" if r["speedup"] is None else f"{r['speedup']:.2f}×"
            why = ", ".join(f"{k} {v}" for k, v in r["why"].items()) or "-"
            print(
                f"| {w['weights']} | {r['case']} | {r['layout']} | {r['tokens']} | "
                f"{r['plain_tps']:.2f} | {r['speculate_tps']:.2f} | {speed} | {acc} | "
                f"{r['draft_tokens']:.0f} | {r['same_reply']} | {why} |"
            )


if __name__ == "__main__":
    main()
