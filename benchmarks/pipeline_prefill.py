"""Prefill throughput across pipeline ranks: whole steps against small pieces, side by side.

    python benchmarks/pipeline_prefill.py --model builtin:base --ranks 2 --tokens 2048
    python benchmarks/pipeline_prefill.py --pieces 512,128,64,32 --repeats 5 --json

A pipeline rank runs its layers on a piece of the prompt, sends the hidden state on
and starts the next piece, so with small pieces every rank works at once
(exokv.model.pipeline.micro_chunks). Each trial prefills --tokens new tokens with
exokv's own `prefill` (the engine's code path, with its one stop check per
PREFILL_STEP, a real collective), once per piece size, the sizes in turn, so noise
hits each alike. A piece of PREFILL_STEP tokens or more is one piece per step: the
prefill as it was before pieces. One rank, which has no pieces, is run first for
reference, in a process of its own.

The ranks are started here, like mlx.launch does it on one machine (MLX_RANK and a
ring hostfile), not through mlx.launch: its per-rank I/O threads spin on a writable
stdin and take one of this machine's 2 cores (exokv's own launcher makes them stop).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from exokv.launch.command import free_ports

HERE = Path(__file__).resolve()


def rank_main(args: argparse.Namespace) -> None:
    """One rank: load its shard, prefill in every piece size in turn, rank 0 reports."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from exokv.errors import ExokvError
    from exokv.model import pipeline
    from exokv.model.loading import load_checkpoint
    from exokv.model.resolve import resolve_model
    from exokv.rank import engine

    group = mx.distributed.init(backend="ring") if args.ranks > 1 else None
    try:
        model, _ = load_checkpoint(Path(resolve_model(args.model)), group)
    except ExokvError as e:
        raise SystemExit(f"pipeline_prefill: {e}") from None

    def agree(_: int) -> bool:  # the engine's stop check between steps: one collective
        if group is not None:
            mx.eval(mx.distributed.all_sum(mx.array(0), group=group))
        return False

    pieces = [int(p) for p in args.pieces.split(",")] if args.ranks > 1 else [0]
    rows: dict[int, list[float]] = {p: [] for p in pieces}
    for trial in range(args.repeats + 1):  # the first round warms up, untimed
        for piece in pieces:
            if piece:
                pipeline.MICRO_CHUNK = piece
            tokens = [(i * 37 + trial * 11 + piece) % 1000 + 5 for i in range(args.tokens)]
            cache = make_prompt_cache(model)
            agree(0)
            tic = time.perf_counter()
            engine.prefill(model, cache, tokens, before_chunk=agree)
            agree(0)  # every rank done
            if trial:
                rows[piece].append(args.tokens / (time.perf_counter() - tic))
    if group is None or group.rank() == 0:
        print(json.dumps({str(p): r for p, r in rows.items()}), flush=True)


def run_ranks(args: argparse.Namespace, ranks: int) -> dict[str, list[float]]:
    env = dict(os.environ)
    procs = []
    with tempfile.TemporaryDirectory() as tmp:
        if ranks > 1:
            hostfile = Path(tmp) / "hosts.json"
            first = free_ports(ranks)  # exokv's own pick for its ranks
            hostfile.write_text(json.dumps([[f"127.0.0.1:{first + r}"] for r in range(ranks)]))
            env["MLX_HOSTFILE"] = str(hostfile)
        for rank in range(ranks):
            env["MLX_RANK"] = str(rank)
            argv = [sys.executable, str(HERE), "--rank-child", "--ranks", str(ranks)]
            argv += ["--model", args.model, "--tokens", str(args.tokens)]
            argv += ["--repeats", str(args.repeats), "--pieces", args.pieces]
            out = subprocess.PIPE if rank == 0 else subprocess.DEVNULL
            procs.append(
                subprocess.Popen(
                    argv, env=dict(env), stdin=subprocess.DEVNULL, stdout=out, stderr=out, text=True
                )
            )
        try:
            stdout, stderr = procs[0].communicate(timeout=args.timeout)
            if procs[0].returncode == 0:
                for p in procs[1:]:
                    p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            raise SystemExit(f"pipeline_prefill: {ranks} rank(s) did not finish in time") from None
        finally:
            for p in procs:  # a rank that failed leaves the others waiting on the ring
                if p.poll() is None:
                    p.kill()
                    p.wait()
    if procs[0].returncode != 0:
        said = [line for line in stderr.splitlines() if line.startswith("pipeline_prefill: ")]
        raise SystemExit(
            said[-1]
            if said
            else f"pipeline_prefill: rank 0 of {ranks} exited {procs[0].returncode}"
        )
    return json.loads(stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="builtin:base")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--pieces", default="512,128,64", help="piece sizes (tokens) to compare")
    ap.add_argument("--timeout", type=float, default=1200)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--rank-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank_child:
        rank_main(args)
        return
    if args.ranks < 2:
        raise SystemExit("pipeline_prefill: --ranks must be 2 or more")
    load = [os.getloadavg()[0]]
    one = run_ranks(args, 1)["0"]
    many = run_ranks(args, args.ranks)
    load.append(os.getloadavg()[0])
    medians = {"1 rank": statistics.median(one)}
    medians |= {
        f"{args.ranks} ranks, {p}-token pieces": statistics.median(v) for p, v in many.items()
    }
    doc: dict[str, Any] = {
        "args": {k: v for k, v in vars(args).items() if k != "rank_child"},
        "load_before_after": load,
        "tokens_per_s": {"1 rank": one, **{f"{args.ranks} ranks, {p}": v for p, v in many.items()}},
        "median_tokens_per_s": medians,
    }
    if args.json:
        print(json.dumps(doc, indent=2))
        return
    print(
        f"{args.model}, {args.tokens:,}-token prefill, {args.repeats} trials "
        f"(load {load[0]:.1f} -> {load[1]:.1f}); medians:"
    )
    base = medians["1 rank"]
    for name, value in medians.items():
        print(f"  {name:32} {value:7.0f} tokens/s  ({value / base:.2f}x one rank)")


if __name__ == "__main__":
    main()
