"""What a batch gains from drafts when they are right: the batch decoder in process.

    python benchmarks/batch_drafts_bound.py --model builtin:base --repeats 3 --json

`serve_speculate.py` measures the server with the drafts prompt lookup finds; a model
that never quotes its prompt (the builtins' random weights) finds none, so it says
nothing of what a verify pass of the batch costs. Here the same 8 rows (each "Repeat
this text exactly, word for word:" and a paragraph of its own, temperature 0) run
through exokv.rank.batch.run_batch three ways, in turn, --repeats times:

- `plain`: `speculate=False` (no drafts);
- `lookup`: drafts from each row's prompt and reply, as the server drafts;
- `right`: each row's drafts are its own plain reply's next tokens (right by
  construction, as a model that quotes its prompt would find them): the bound.

Decode tokens/s = all rows' tokens but their first / the wall time from the first
text any row streams to run_batch's end (the prefill, the same in all three, is left
out). Medians; every run's replies must equal `plain`'s.

Before the runs, what one batch step costs with each row running k tokens (its
token and a draft of k - 1) over a step of one token a row, medians of 3 after a
prompt of about 90 tokens a row: with every draft kept a step of k yields k tokens a
row, so k / that cost bounds what drafts can gain in a batch on these weights.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_speculate import parse_args, prompts  # noqa: E402 - the server run's rows

from exokv.core.records import TurnRequest  # noqa: E402
from exokv.model.resolve import load_model  # noqa: E402
from exokv.rank import batch_drafts  # noqa: E402
from exokv.rank.batch import run_batch  # noqa: E402
from exokv.rank.draft import Drafter  # noqa: E402
from exokv.rank.engine import Engine  # noqa: E402


class _Right(Drafter):
    """Drafts a row's plain reply from where its reply is."""

    def __init__(self, tokens: Sequence[int], script: list[int]) -> None:
        super().__init__(tokens)
        self.prompt, self.script = len(tokens), script

    def propose(self, k: int) -> list[int]:
        at = len(self.lookup.tokens) - self.prompt
        return self.script[at : at + k]


def once(model: Any, tokenizer: Any, streams: int, max_tokens: int, speculate: bool) -> dict:
    engine = Engine(model, tokenizer)
    rows = [
        TurnRequest(f"s{i}", m, max_tokens=max_tokens, speculate=speculate)
        for i, m in enumerate(prompts(streams))
    ]
    texts: list[float] = []
    out = run_batch(engine, rows, on_text=lambda i, p: texts.append(time.perf_counter()))
    wall = time.perf_counter() - texts[0]
    results = [o.result for o in out]
    return {
        # From the first text on: the decode (the prefill, the same in all, left out).
        "tokens_per_s": (sum(r.generated_tokens for r in results) - len(results)) / wall,
        "replies": [r.reply for r in results],
        "tokens": [r.reply_tokens for r in results],
        "drafted": sum(r.draft_tokens for r in results),
        "kept": sum(r.accepted_tokens for r in results),
        "prompts": [engine.render(r.messages) for r in rows],
    }


def step_costs(model: Any, rows: int, ks: Sequence[int] = (1, 2, 3, 5, 9)) -> dict[str, float]:
    """Seconds of a batch step of `rows` rows × k tokens, over rows left-padded as a
    merged batch is (mlx-lm's BatchKVCache), medians of 3 after one untimed step."""
    import mlx.core as mx  # deferred: the model is loaded already
    from mlx_lm.models.cache import BatchKVCache

    lengths = [40 + 7 * i for i in range(rows)]
    pads = [max(lengths) - n for n in lengths]
    prompt = mx.array([[0] * p + list(range(5, 5 + n)) for p, n in zip(pads, lengths, strict=True)])
    cache = [BatchKVCache(pads) for _ in model.layers]
    mx.eval(model(prompt, cache=cache))
    out = {}
    for k in ks:
        times = []
        for _ in range(4):
            tic = time.perf_counter()
            mx.eval(model(mx.array([[7] * k] * rows), cache=cache))
            times.append(time.perf_counter() - tic)
            for c in cache:
                c.trim(k)
        out[str(k)] = statistics.median(times[1:])
    return out


def main() -> None:
    args = parse_args(doc=__doc__)  # the server run's options: the same rows, in process
    model, tokenizer = load_model(args.model)
    results: dict[str, Any] = {"model": args.model, "load_average_before": os.getloadavg()}
    costs = step_costs(model, args.streams)
    results["step_cost_s"] = {k: round(v, 3) for k, v in costs.items()}
    results["best_case_gain"] = {k: round(int(k) * costs["1"] / v, 2) for k, v in costs.items()}
    print("batch step cost", json.dumps(results["step_cost_s"]), file=sys.stderr, flush=True)
    runs: dict[str, list[dict]] = {"plain": [], "lookup": [], "right": []}
    plain = once(model, tokenizer, args.streams, args.max_tokens, False)  # warm-up, and scripts
    pairs = zip(plain["prompts"], plain["tokens"], strict=True)
    scripts = {tuple(t): s + [0] * 16 for t, s in pairs}
    real = batch_drafts.Drafter
    for _ in range(args.repeats):
        runs["plain"].append(once(model, tokenizer, args.streams, args.max_tokens, False))
        runs["lookup"].append(once(model, tokenizer, args.streams, args.max_tokens, True))
        batch_drafts.Drafter = lambda t: _Right(t, scripts[tuple(t)])  # type: ignore[misc]
        try:
            runs["right"].append(once(model, tokenizer, args.streams, args.max_tokens, True))
        finally:
            batch_drafts.Drafter = real  # type: ignore[misc]
    for name, trials in runs.items():
        rates = [r["tokens_per_s"] for r in trials]
        results[name] = {
            "tokens_per_s": [round(x, 1) for x in rates],
            "median_tokens_per_s": round(statistics.median(rates), 1),
            "drafted": trials[-1]["drafted"],
            "kept": trials[-1]["kept"],
            "same_replies": all(r["replies"] == plain["replies"] for r in trials),
        }
    for name in ("lookup", "right"):
        ratio = results[name]["median_tokens_per_s"] / results["plain"]["median_tokens_per_s"]
        results[name]["ratio"] = round(ratio, 2)
    results["load_average_after"] = os.getloadavg()
    if args.json:
        print(json.dumps(results, indent=2))
        return
    for name in runs:
        r = results[name]
        print(
            f"{name:<7} {r['median_tokens_per_s']:>7.1f} tok/s {r.get('ratio', 1.0)}x "
            f"drafted {r['drafted']} kept {r['kept']} same replies {r['same_replies']}"
        )


if __name__ == "__main__":
    main()
