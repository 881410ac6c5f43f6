"""Structured output (issue 44): what a grammar costs per decoded token.

    python benchmarks/structured.py --model builtin:tiny --model smollm2 --repeat 5

One engine per model in this process, one rank. Each repeat runs, alternating which
goes first, the same request unconstrained and constrained by a JSON schema whose
one string property lets the model write up to `--max-tokens` (so both decode about
as many tokens): alone (mlx-lm's generate_step with the grammar as a logits
processor; no drafts either way) and as a batch of `--rows` rows (the batch's
sampler, each row its own grammar). Reported: medians of decode tokens/s (per row)
and the cost per token the grammar adds (1/tps constrained - 1/tps free).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from typing import Any

from exokv.core.records import TurnRequest
from exokv.model.resolve import load_model
from exokv.prompt import grammar
from exokv.rank.batch import run_batch
from exokv.rank.engine import Engine

ASK = [{"role": "user", "content": "Write a long story about a lighthouse keeper, as JSON."}]
STORY = {
    "type": "object",
    "properties": {"title": {"type": "string"}, "story": {"type": "string"}},
    "required": ["title", "story"],
    "additionalProperties": False,
}


def _request(i: int, max_tokens: int, constrained: bool) -> TurnRequest:
    return TurnRequest(
        session=f"s{i}",
        messages=ASK,
        max_tokens=max_tokens,
        use_cache=False,
        speculate=False,
        grammar=grammar.from_schema(STORY) if constrained else None,
    )


def _alone(engine: Engine, max_tokens: int, constrained: bool) -> tuple[float, int]:
    result = engine.turn(_request(0, max_tokens, constrained))
    return result.decode_tps, result.generated_tokens


def _batch(engine: Engine, max_tokens: int, constrained: bool, rows: int) -> tuple[float, int]:
    requests = [_request(i, max_tokens, constrained) for i in range(rows)]
    # use_cache False runs rows alone; a batch needs the cache: distinct sessions.
    for r in requests:
        r.use_cache = True
    results = [o.result for o in run_batch(engine, requests)]
    tps = statistics.median(r.decode_tps for r in results)
    return tps, sum(r.generated_tokens for r in results) // len(results)


def measure(model_name: str, repeat: int, max_tokens: int, rows: int) -> dict[str, Any]:
    model, tokenizer = load_model(model_name)
    engine = Engine(model, tokenizer)
    cases: dict[str, Callable[[bool], tuple[float, int]]] = {
        "alone": lambda c: _alone(engine, max_tokens, c),
        f"batch of {rows}": lambda c: _batch(engine, max_tokens, c, rows),
    }
    for run in cases.values():  # warm-up: the grammar library reads the tokenizer once
        run(True)
        run(False)
    out: dict[str, Any] = {"model": model_name, "cases": {}}
    for name, run in cases.items():
        rates: dict[bool, list[float]] = {True: [], False: []}
        tokens: dict[bool, list[int]] = {True: [], False: []}
        for i in range(repeat):
            for constrained in (i % 2 == 0, i % 2 == 1):
                tps, n = run(constrained)
                rates[constrained].append(tps)
                tokens[constrained].append(n)
        free, held = statistics.median(rates[False]), statistics.median(rates[True])
        out["cases"][name] = {
            "free_tps": round(free, 1),
            "constrained_tps": round(held, 1),
            "free_tokens": statistics.median(tokens[False]),
            "constrained_tokens": statistics.median(tokens[True]),
            "added_ms_per_token": round((1 / held - 1 / free) * 1000, 2),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", default=None)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    runs = [
        measure(m, args.repeat, args.max_tokens, args.rows) for m in args.model or ["builtin:tiny"]
    ]
    if args.json:
        print(json.dumps(runs, indent=1))
        return
    for run in runs:
        print(run["model"])
        for name, row in run["cases"].items():
            print(
                f"  {name:12} free {row['free_tps']:7.1f} tok/s ({row['free_tokens']} tokens)"
                f"   constrained {row['constrained_tps']:7.1f} tok/s"
                f" ({row['constrained_tokens']} tokens)   +{row['added_ms_per_token']} ms/token"
            )


if __name__ == "__main__":
    main()
