"""A long prefill's time left: how far exokv.chat.eta's estimate and the average rate
since the start (what a progress bar's own rate would promise) are from the truth.

    python benchmarks/prefill_eta.py --model builtin:tiny --words 1400 --runs 3

Each run prefills one long message (about 2.3 tokens a word on builtin:tiny) on one engine in this
process, no cache, recording every progress report (time, tokens done). Then, at
every report between 10% and 90% of the prompt, each estimator is given the reports so
far and its time left is divided by the time the prefill really took from there:
1.0 is right, below 1 promises too little. Reported per run: the median and the 10th
and 90th percentiles of that ratio, with the load average. On a shared machine each
step's time moves with the other work, so no estimator is better than its noise.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from exokv.chat.eta import PrefillClock
from exokv.core.records import TurnRequest


def trace(engine: object, words: int) -> list[tuple[float, int, int]]:
    text = " ".join(f"stone {i} river light" for i in range(words // 4))
    stamps: list[tuple[float, int, int]] = []
    start = time.perf_counter()
    messages = [{"role": "user", "content": text}]
    request = TurnRequest("eta", messages, max_tokens=1, use_cache=False)

    def report(done: int, total: int) -> None:
        stamps.append((time.perf_counter() - start, done, total))

    engine.turn(request, on_progress=report)  # type: ignore[attr-defined]
    return stamps


def ratios(stamps: list[tuple[float, int, int]]) -> dict[str, list[float]]:
    end, total = stamps[-1][0], stamps[0][2]
    clock = PrefillClock()
    out: dict[str, list[float]] = {"eta": [], "average": []}
    for now, done, _ in stamps:
        clock.report(now, done)
        left = clock.left(total)
        if not 0.1 < done / total < 0.9 or left is None or end - now <= 0:
            continue
        average = (total - done) * now / done
        out["eta"].append(left / (end - now))
        out["average"].append(average / (end - now))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:tiny")
    parser.add_argument("--words", type=int, default=1400 * 4)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    from exokv.model.resolve import load_model  # deferred: mlx-lm (2 s) after the arguments
    from exokv.rank.engine import Engine  # deferred: likewise

    model, tokenizer = load_model(args.model)
    for run in range(1, args.runs + 1):
        load = os.getloadavg()[0]
        stamps = trace(Engine(model, tokenizer), args.words)
        found = ratios(stamps)
        parts = []
        for name, values in found.items():
            q = statistics.quantiles(values, n=10)
            parts.append(f"{name} {statistics.median(values):.2f} ({q[0]:.2f}-{q[-1]:.2f})")
        took = stamps[-1][0]
        print(f"run {run}: {stamps[0][2]:,} tokens in {took:.1f} s, load {load:.1f}: "
              + ", ".join(parts))  # fmt: skip


if __name__ == "__main__":
    main()
