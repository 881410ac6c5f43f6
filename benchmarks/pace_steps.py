"""What one-token prefill steps cost on a slow model: the first prefill, by the pace's floor.

    python benchmarks/pace_steps.py --model smollm2 --rounds 3

Issue 45 lowered the pace's floor (exokv.rank.pace: FIRST_TOKENS, FEWEST_TOKENS) from a
first step of 8 and steps of at least 4 tokens to one token, so that a Ctrl-C lands
within a step's time on a model slower than a few tokens per quarter second. This
runs one turn's prefill in process (one rank, `use_cache=False`, one token of reply)
with each floor in turn, alternating, and prints the TTFT's median for each.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

FLOORS = {"first 8, at least 4": (8, 4), "first 2, at least 2": (2, 2), "one token": (1, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    import exokv.rank.pace as pace
    from exokv.core.records import TurnRequest
    from exokv.model.resolve import load_model
    from exokv.rank.engine import PREFILL_STEP, Engine

    model, tokenizer = load_model(args.model)
    ttft: dict[str, list[float]] = {name: [] for name in FLOORS}
    steps: dict[str, list[int]] = {}
    load = [os.getloadavg()[0]]
    for i in range(args.rounds):
        for name, (first, fewest) in FLOORS.items():
            pace.FEWEST_TOKENS = fewest  # read by Pace.tokens()
            engine = Engine(model, tokenizer)
            engine.pace = pace.Pace(first=first, most=PREFILL_STEP)
            line = f"Hello there {i} {first}, how are you today? Tell me about the sea and stars."
            result = engine.turn(
                TurnRequest("s", [{"role": "user", "content": line}], max_tokens=1, use_cache=False)
            )
            ttft[name].append(result.ttft_s)
            steps[name] = engine.prefill_steps
    load.append(os.getloadavg()[0])
    report = {
        "model": args.model,
        "load_1min": load,
        "prompt_steps": steps,
        "ttft_s": ttft,
        "median_ttft_s": {n: round(statistics.median(v), 2) for n, v in ttft.items()},
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"{args.model}: load {load[0]:.1f} -> {load[1]:.1f}")
    for name, values in ttft.items():
        shown = ", ".join(f"{v:.2f}" for v in values)
        print(f"  {name:20} median TTFT {statistics.median(values):6.2f} s  ({shown}; "
              f"{len(steps[name])} steps)")  # fmt: skip


if __name__ == "__main__":
    main()
