"""Prefill throughput typed ahead (draft steps) against a plain prefill, side by side.

    python benchmarks/spec_prefill.py --model builtin:base --ranks 1 --tokens 2000
    python benchmarks/spec_prefill.py --model builtin:base --ranks 2 --starting-port 29200
    python benchmarks/spec_prefill.py --ranks 1 --chunks 128,256,512   # one rank only

Each trial is a new paste of about --tokens tokens after the same short first turn
(its tokens differ from every other trial's, so nothing of it is cached):

- plain: the turn itself (`max_tokens` 1), as Enter without typing ahead runs it;
  throughput is the prompt's new tokens over the engine's TTFT;
- typed ahead: `Client.draft(..., wait=True)`, the draft's steps until its stable part
  is all in the tree; throughput is the tokens that added over that wall time. The turn
  that follows is timed too (what is left for Enter).

Trials alternate plain and typed ahead (and, on one rank, each --chunks size, the
tokens of one typeahead step), so machine noise hits every mode alike; medians are
reported with the load average before and after, and with each trial the seconds an
idle probe process was not run meanwhile (benchmarks/stalls.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from resume import WORDS
from stalls import StallProbe, stalled

FIRST = "Hello there."


def paste(trial: int, tokens: int) -> str:
    """About `tokens` tokens of builtin text, its word order set by `trial`."""
    words = [WORDS[(i * 7 + trial * 3 + i // 20) % len(WORDS)] for i in range(int(tokens / 2.9))]
    lines = [" ".join(words[i : i + 12]) + "." for i in range(0, len(words), 12)]
    return f"Trial {trial}.\n" + "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="builtin:base")
    ap.add_argument("--ranks", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--chunks", default="", help="typeahead step sizes to compare (1 rank)")
    ap.add_argument("--starting-port", type=int, default=29200)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    from exokv.client import make_client
    from exokv.config import exokv_home
    from exokv.core.records import TurnRequest
    from exokv.frontend.start import ChatOptions, validate
    from exokv.rank import typeahead

    chunks = [int(c) for c in args.chunks.split(",") if c] or [typeahead.STEP_TOKENS]
    if args.ranks > 1 and chunks != [typeahead.STEP_TOKENS]:
        raise SystemExit("--chunks: one rank only (the ranks' step size is theirs)")
    home = Path(tempfile.mkdtemp(prefix="exokv-specprefill-"))
    models = exokv_home() / "models"
    if models.is_dir():
        (home / "models").symlink_to(models)
    os.environ["EXOKV_HOME"] = str(home)
    opts = ChatOptions(
        model=args.model, ranks=args.ranks, starting_port=args.starting_port, restarts=0
    )
    client = make_client(validate(opts))
    probe = StallProbe()
    load = [os.getloadavg()[0]]
    first = [{"role": "user", "content": FIRST}]
    reply = client.turn(TurnRequest("bench", first, max_tokens=8)).reply
    history = [*first, {"role": "assistant", "content": reply}]
    modes = ["plain"] + [f"typed ahead, {c}-token steps" for c in chunks]
    rows: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    trial = 0
    try:
        for _ in range(args.repeats):
            for mode, chunk in zip(modes, [None, *chunks], strict=True):
                trial += 1
                text = paste(trial, args.tokens)
                request = TurnRequest("bench", [*history, {"role": "user", "content": text}], 1)
                row: dict[str, Any] = {}
                began = time.monotonic()
                if chunk is not None:
                    typeahead.STEP_TOKENS = chunk  # the engine in this process (1 rank)
                    tic = time.perf_counter()
                    client.draft("bench", history, text, wait=True)
                    row["draft_s"] = time.perf_counter() - tic
                result = client.turn(request)
                ahead = result.typed_ahead_tokens
                new = result.prompt_tokens - result.cached_tokens
                row.update(
                    ttft_s=result.ttft_s,
                    typed_ahead=ahead,
                    prefilled=new,
                    tok_s=(ahead / row["draft_s"]) if chunk is not None else new / result.ttft_s,
                    machine_stalled_s=stalled(probe.gaps(), began, time.monotonic()),
                )
                rows[mode].append(row)
                print(f"  {mode}: {row}", file=sys.stderr)
    finally:
        client.close()
        probe.close()
    load.append(os.getloadavg()[0])
    summary = {m: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for m, rs in rows.items()}
    doc = {"args": vars(args), "load_before_after": load, "trials": rows, "median": summary}
    if args.json:
        print(json.dumps(doc, indent=2))
        return
    print(
        f"{args.model}, {args.ranks} rank(s), ~{args.tokens:,}-token pastes, "
        f"{args.repeats} trials each (load {load[0]:.1f} -> {load[1]:.1f}); medians:"
    )
    for m, s in summary.items():
        extra = f", then the turn: TTFT {s['ttft_s']:.3f} s" if "draft_s" in s else ""
        took = s.get("draft_s", s["ttft_s"])
        print(
            f"  {m:28} {s['tok_s']:7.0f} tokens/s ({took:.2f} s){extra}; "
            f"machine stalled {s['machine_stalled_s']:.2f} s"
        )


if __name__ == "__main__":
    main()
