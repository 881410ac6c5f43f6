"""Decode tokens/s and time to first token on a real model: exokv against
`mlx_lm.generate`'s own loop on one rank, and two pipeline ranks against one.

    python benchmarks/real_model_speed.py --model smollm2 --max-tokens 32 --repeat 3

One run, side by side: the ranks are started first (they wait asleep between
turns), then each repeat runs the same prompt through mlx-lm's `stream_generate`
(what `mlx_lm.generate` prints its figures from), exokv's engine on one rank, and
exokv on the ranks, each first in turn, so machine load hits all three alike. exokv runs
without the cache (the whole prompt prefilled, as mlx-lm does). Both sides count
alike: TTFT from the call to the first token, decode tokens/s over the tokens after
the first. Medians. Prints a table, or with --json one JSON document.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from bench_common import pipeline_client
from mlx_lm import stream_generate
from mlx_lm.sample_utils import make_sampler

from exokv.core.records import TurnRequest
from exokv.model.resolve import load_model
from exokv.rank.engine import Engine, EngineOptions

PROMPT = "Write a long story about a dragon who learns to bake bread."


def mlx_lm_run(model: Any, tokenizer: Any, tokens: list[int], max_tokens: int) -> dict[str, Any]:
    times: list[float] = []
    text = ""
    start = time.perf_counter()
    for response in stream_generate(
        model, tokenizer, tokens, max_tokens=max_tokens, sampler=make_sampler(temp=0.0)
    ):
        times.append(time.perf_counter())
        text += response.text
    n = len(times)
    tps = (n - 1) / (times[-1] - times[0]) if n > 1 else 0.0
    return {"ttft_s": times[0] - start, "decode_tps": tps, "tokens": n, "reply": text}


def exokv_run(turn: Any, request: TurnRequest) -> dict[str, Any]:
    result = turn(request)
    return {
        "ttft_s": result.ttft_s,
        "decode_tps": result.decode_tps,
        "tokens": result.generated_tokens,
        "reply": result.reply,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    model, tokenizer = load_model(args.model)
    engine = Engine(model, tokenizer, options=EngineOptions())
    messages = [{"role": "user", "content": PROMPT}]
    request = TurnRequest("bench", messages, max_tokens=args.max_tokens, use_cache=False)
    tokens = engine.render(messages)
    assert tokens == list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    client = pipeline_client(args.model, args.max_tokens, args.starting_port)
    runs: dict[str, list[dict[str, Any]]] = {"mlx_lm": [], "exokv": [], "exokv_2_ranks": []}
    try:
        do = {
            "mlx_lm": lambda: mlx_lm_run(model, tokenizer, tokens, args.max_tokens),
            "exokv": lambda: exokv_run(engine.turn, request),
            "exokv_2_ranks": lambda: exokv_run(client.turn, request),
        }
        order = list(do)
        for i in range(args.repeat):
            for name in order[i % 3 :] + order[: i % 3]:  # each goes first in turn
                runs[name].append(do[name]())
    finally:
        client.close()
    replies = {name: {r["reply"] for r in rs} for name, rs in runs.items()}
    summary = {
        name: {
            "ttft_s": statistics.median(r["ttft_s"] for r in rs),
            "decode_tps": statistics.median(r["decode_tps"] for r in rs),
            "tokens": rs[0]["tokens"],
        }
        for name, rs in runs.items()
    }
    one, ref, two = summary["exokv"], summary["mlx_lm"], summary["exokv_2_ranks"]
    return {
        "model": args.model,
        "prompt_tokens": len(tokens),
        "max_tokens": args.max_tokens,
        "repeat": args.repeat,
        "summary": summary,
        "ratios": {
            "exokv_vs_mlx_lm_decode": one["decode_tps"] / ref["decode_tps"],
            "exokv_vs_mlx_lm_ttft": one["ttft_s"] / ref["ttft_s"],
            "two_ranks_vs_one_decode": two["decode_tps"] / one["decode_tps"],
            "two_ranks_vs_one_ttft": two["ttft_s"] / one["ttft_s"],
        },
        "same_reply": len(set().union(*replies.values())) == 1,
        "runs": runs,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--starting-port", type=int, default=26700)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    doc = run(args)
    if args.json:
        print(json.dumps(doc, indent=1))
        return
    print(f"{doc['model']}: {doc['prompt_tokens']} prompt tokens, {doc['max_tokens']} max tokens,")
    print(f"median of {doc['repeat']}; same reply everywhere: {doc['same_reply']}")
    print("| run | TTFT | decode tokens/s | tokens |")
    print("| --- | ---: | ---: | ---: |")
    for name, s in doc["summary"].items():
        print(f"| {name} | {s['ttft_s']:.2f} s | {s['decode_tps']:.2f} | {s['tokens']} |")
    for name, ratio in doc["ratios"].items():
        print(f"{name}: {ratio:.3f}")


if __name__ == "__main__":
    main()
