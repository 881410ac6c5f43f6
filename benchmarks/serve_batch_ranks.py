"""`exokv serve --batch N` against `--batch 1` on several ranks: decode throughput.

    python benchmarks/serve_batch_ranks.py --ranks 2 --repeats 5 --json

Two servers on the same model and layout (`-n RANKS`), both up at once and measured
in turn (trials alternate, so the noise of a shared machine falls on both alike):
`--batch N` (concurrent requests decoded together) and `--batch 1` (one at a time,
which is what a server on several ranks ran before batches could stop a row on time).
Each trial sends 8 streams at once (the `openai` client, temperature 0, each its own
prompt) and takes the aggregate tokens/s: all completion tokens / the wall time from
the first request to the last token (serve_vs_mlx_lm.py's workload 1). Medians.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from serve_vs_mlx_lm import Server, throughput  # noqa: E402 - the same workload, not a copy


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="builtin:base")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--starting-port", type=int, default=28400, help="the first server's ranks")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()

    from exokv.model.resolve import resolve_model

    source = Path(os.environ.get("EXOKV_HOME", ""))
    homes = [Path(tempfile.mkdtemp(prefix="serve-ranks-bench-")) for _ in range(2)]
    for home in homes:
        if (source / "models").exists():
            (home / "models").symlink_to(source / "models", target_is_directory=True)
    os.environ["EXOKV_HOME"] = str(homes[0])
    resolve_model(args.model)  # generated once (or found), before the servers start
    if not (source / "models").exists():
        (homes[1] / "models").symlink_to(homes[0] / "models", target_is_directory=True)

    servers: dict[str, Server] = {}
    try:
        for k, (name, batch) in enumerate([(f"batch{args.batch}", args.batch), ("batch1", 1)]):
            argv = [sys.executable, "-m", "exokv", "serve", "--model", args.model]
            argv += ["--port", "{port}", "--disk-budget", "0", "--queue", "64"]
            argv += ["--batch", str(batch), "-n", str(args.ranks)]
            argv += ["--starting-port", str(args.starting_port + 10 * k)]
            env = {**os.environ, "EXOKV_HOME": str(homes[k])}
            servers[name] = Server(f"exokv {name}", argv, env, "serving ")
        trials: dict[str, list[float]] = {name: [] for name in servers}
        for trial in range(args.repeats):
            for name, server in servers.items():
                tps = throughput(server, args.model, args.streams, args.max_tokens, trial)
                trials[name].append(tps)
                print(f"trial {trial + 1}: {name} {tps:.1f} tok/s", file=sys.stderr, flush=True)
        batched = [x for x in servers[f"batch{args.batch}"].log if "batch=" in x]
    finally:
        for server in servers.values():
            server.stop()
        for home in homes:
            shutil.rmtree(home, ignore_errors=True)
    medians = {name: statistics.median(v) for name, v in trials.items()}
    result: dict[str, Any] = {
        "model": args.model,
        "args": vars(args),
        "tok_s": trials,
        "median_tok_s": medians,
        "ratio": medians[f"batch{args.batch}"] / medians["batch1"],
        "batched_requests": len(batched),  # access lines that say batch=N
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for name, value in medians.items():
            print(f"{name}: median {value:.1f} tok/s over {args.repeats} trials")
        print(f"ratio: {result['ratio']:.2f}")


if __name__ == "__main__":
    main()
