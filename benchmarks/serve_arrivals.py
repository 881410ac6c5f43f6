"""Staggered arrivals: `exokv serve` against `mlx_lm.server`, requests that do not come together.

    python benchmarks/serve_arrivals.py --model builtin:base
    python benchmarks/serve_arrivals.py --model builtin:base --ranks 2
    python benchmarks/serve_arrivals.py --only staggered --only burst \
        --staggered 16,64 --staggered-gap-ms 50,250 --burst 64

Both servers up at once, measured in turn (servers started as in serve_vs_mlx_lm.py:
on 2 ranks exokv's pipeline ranks against `mlx.launch ... mlx_lm.server --pipeline`,
whose idle-spinning ranks are paused while exokv is measured), each driven by the real
`openai` client, every request streamed at temperature 0:

1. **staggered**: --staggered requests (16) with one shared system prompt, one sent
   every --staggered-gap-ms (50), --staggered-tokens (256) tokens each. Both take a
   comma list (16,64 and 50,250): every pair is a workload of its own.
2. **heavy**: --heavy requests (32), one every --heavy-gap-ms (20), prompts of mixed
   lengths up to --longest (2,000) tokens (a fifth of them that long), --heavy-tokens
   (64) tokens each.
3. **newcomer**: --streams (4) short requests decoding --stream-tokens (512) tokens
   each, and --newcomer-after-s (3) seconds after them one --longest-token newcomer
   (its own system prompt, so nothing of it is cached): the longest pause the running
   streams see while it prefills. In the heavy workload every request arrives before
   any stream decodes, so only this one measures the pause.
4. **burst**: --burst requests (64; a comma list too), as the staggered ones but all
   sent at once.

For each: mean and p90 time to first token (request sent -> first content chunk),
tokens/s (every completion token / first request sent to last token), the CPU time the
server's processes used (`server_cpu_s`; the text table: per token), and the longest
pause a running stream sees while a --longest-token newcomer prefills (the largest gap
between two content chunks of any stream that was decoding from before the newcomer
was sent until after its first token; the gap counted if it overlaps that window).
Each trial's prompts are new (the trial's number leads the system prompt), so both
servers start each trial cold and share the system prompt within it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serve_vs_mlx_lm as base  # noqa: E402 - its Server and the mlx_lm.server wrapper

WORKLOADS = ("staggered", "heavy", "newcomer", "burst")

WORDS = (
    "rack node cable switch power fan disk cache layer token model batch queue shard "
    "rank port socket thread kernel memory budget prefix tree entry evict spill write"
).split()


def prompt_of(tokenizer: Any, n: int, salt: int) -> str:
    """About `n` tokens of text (cut at `n` tokens of the model's tokenizer)."""
    words = [WORDS[(salt * 7 + i * 13) % len(WORDS)] for i in range(n * 2)]
    ids = tokenizer.encode(" ".join(words))[:n]
    return tokenizer.decode(ids)


def timed_stream(server: base.Server, model: str, messages: list[dict], max_tokens: int) -> dict:
    """One streamed completion: when it was sent, when each content chunk came, tokens."""
    return base.stream_turn(server, model, messages, max_tokens)


def arrivals(
    server: base.Server, model: str, requests: list[list[dict]], gap_s: float, max_tokens: int
) -> list[dict]:
    """Send `requests` one every `gap_s`, each from its own thread; their runs, in order."""
    runs: list[dict | None] = [None] * len(requests)

    def one(i: int) -> None:
        runs[i] = timed_stream(server, model, requests[i], max_tokens)

    with ThreadPoolExecutor(len(requests)) as pool:
        start = time.perf_counter()
        futures = []
        for i in range(len(requests)):
            delay = start + i * gap_s - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            futures.append(pool.submit(one, i))
        for f in futures:
            f.result()
    return [r for r in runs if r is not None]


def cpu_seconds(server: base.Server) -> float:
    """CPU time (user + system) used so far by the server's process and its children
    (its ranks): over a workload, the machine's share a server's way of serving costs,
    which decides its tokens/s where the cores are all busy (two cores, two servers'
    processes, the client's 64 threads and anyone else's work)."""
    try:
        root = psutil.Process(server.proc.pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0.0
    for proc in procs:
        try:
            times = proc.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


def figures(runs: list[dict], long_ones: list[int]) -> dict[str, float]:
    ttfts = sorted((r["chunks"][0] if r["chunks"] else r["end"]) - r["sent"] for r in runs)
    wall = max(r["end"] for r in runs) - min(r["sent"] for r in runs)
    out = {
        "ttft_mean_s": statistics.fmean(ttfts),
        "ttft_p90_s": ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))],
        "tokens_per_s": sum(r["tokens"] for r in runs) / wall,
        "tokens": float(sum(r["tokens"] for r in runs)),
    }
    pauses = []
    for k in long_ones:
        newcomer = runs[k]
        lo = newcomer["sent"]
        hi = newcomer["chunks"][0] if newcomer["chunks"] else newcomer["end"]
        for j, r in enumerate(runs):
            c = r["chunks"]
            if j == k or len(c) < 2 or not (c[0] < lo and c[-1] > hi):
                continue  # not decoding through the newcomer's prefill
            gaps = [b - a for a, b in zip(c, c[1:], strict=False) if b > lo and a < hi]
            if gaps:
                pauses.append(max(gaps))
    out["longest_pause_s"] = max(pauses) if pauses else -1.0
    out["long_newcomers_with_a_running_stream"] = float(len(pauses) > 0)
    return out


def staggered(n: int, trial: int) -> list[list[dict]]:
    system = f"(trial {trial}) " + base.SYSTEM
    return [
        [
            {"role": "system", "content": system},
            {"role": "user", "content": f"request {i}: what does machine {i} in the rack do?"},
        ]
        for i in range(n)
    ]


def heavy(tokenizer: Any, args: argparse.Namespace, trial: int) -> tuple[list[list[dict]], list]:
    """Mixed prompt lengths, every fifth one --longest tokens; the indices of those."""
    lengths = [
        args.longest if i % 5 == 4 else (60, 250, 600, 1200)[i % 5] for i in range(args.heavy)
    ]
    system = f"(trial {trial}) " + base.SYSTEM
    requests = [
        [
            {"role": "system", "content": system},
            {"role": "user", "content": prompt_of(tokenizer, n, trial * 1000 + i)},
        ]
        for i, n in enumerate(lengths)
    ]
    return requests, [i for i, n in enumerate(lengths) if n == args.longest]


def newcomer(tokenizer: Any, args: argparse.Namespace, trial: int) -> list[list[dict]]:
    """--streams short requests, then the --longest-token newcomer (last)."""
    system = f"(trial {trial}) " + base.SYSTEM
    short = [
        [
            {"role": "system", "content": system},
            {"role": "user", "content": f"stream {i}: describe machine {i} in the rack."},
        ]
        for i in range(args.streams)
    ]
    # Its own system prompt: the newcomer's whole prompt is prefilled, none of it cached.
    long = [{"role": "user", "content": prompt_of(tokenizer, args.longest, trial * 1000 + 999)}]
    return [*short, long]


def running_then_newcomer(
    server: base.Server, model: str, requests: list[list[dict]], args: argparse.Namespace
) -> list[dict]:
    """The short requests at once, the newcomer --newcomer-after-s later; runs in order."""
    runs: list[dict | None] = [None] * len(requests)
    tokens = [args.stream_tokens] * (len(requests) - 1) + [args.heavy_tokens]

    def one(i: int) -> None:
        runs[i] = timed_stream(server, model, requests[i], tokens[i])

    with ThreadPoolExecutor(len(requests)) as pool:
        futures = [pool.submit(one, i) for i in range(len(requests) - 1)]
        time.sleep(args.newcomer_after_s)
        futures.append(pool.submit(one, len(requests) - 1))
        for f in futures:
            f.result()
    return [r for r in runs if r is not None]


def run_staggered(n: int, gap_ms: float) -> Any:
    """The staggered workload of `n` requests `gap_ms` apart (0: a burst)."""

    def run(
        server: base.Server, model: str, tokenizer: Any, args: argparse.Namespace, trial: int
    ) -> dict[str, float]:
        runs = arrivals(server, model, staggered(n, trial), gap_ms / 1000, args.staggered_tokens)
        return figures(runs, [])

    return run


def run_heavy(
    server: base.Server, model: str, tokenizer: Any, args: argparse.Namespace, trial: int
) -> dict[str, float]:
    reqs, long_ones = heavy(tokenizer, args, trial)
    runs = arrivals(server, model, reqs, args.heavy_gap_ms / 1000, args.heavy_tokens)
    return {**figures(runs, long_ones), "prompt_tokens_max": max(r["prompt"] for r in runs)}


def run_newcomer(
    server: base.Server, model: str, tokenizer: Any, args: argparse.Namespace, trial: int
) -> dict[str, float]:
    runs = running_then_newcomer(server, model, newcomer(tokenizer, args, trial), args)
    return {**figures(runs, [len(runs) - 1]), "newcomer_prompt_tokens": runs[-1]["prompt"]}


def cases(args: argparse.Namespace) -> dict[str, Any]:
    """Each workload asked for, by the name its results go under, and how it runs."""
    out: dict[str, Any] = {}
    for work in args.workloads:
        if work == "staggered":
            for n in args.staggered:
                for gap in args.staggered_gap_ms:
                    out[f"staggered-{n}x{gap:g}ms"] = run_staggered(n, gap)
        elif work == "burst":
            for n in args.burst:
                out[f"burst-{n}"] = run_staggered(n, 0.0)
        else:
            out[work] = {"heavy": run_heavy, "newcomer": run_newcomer}[work]
    return out


def counts(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def gaps(text: str) -> list[float]:
    return [float(x) for x in text.split(",")]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = base._Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="builtin:base")
    p.add_argument("--ranks", type=int, default=1, help="ranks of each server (2+: pipeline)")
    p.add_argument("--starting-port", type=int, default=28400)
    p.add_argument("--batch", type=int, help="exokv serve --batch (default: exokv's own)")
    p.add_argument(
        "--also-batch", type=int, help="a second exokv server with this --batch, beside the first"
    )
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--staggered", type=counts, default=[16], help="requests: 16 or 16,64")
    p.add_argument("--staggered-gap-ms", type=gaps, default=[50.0], help="50 or 50,250")
    p.add_argument("--burst", type=counts, default=[64], help="requests sent at once: 64")
    p.add_argument("--staggered-tokens", type=int, default=256)
    p.add_argument("--heavy", type=int, default=32)
    p.add_argument("--heavy-gap-ms", type=float, default=20)
    p.add_argument("--heavy-tokens", type=int, default=64)
    p.add_argument("--longest", type=int, default=2000)
    p.add_argument("--streams", type=int, default=4, help="running streams (newcomer trial)")
    p.add_argument("--stream-tokens", type=int, default=512)
    p.add_argument("--newcomer-after-s", type=float, default=3.0)
    p.add_argument(
        "--only", action="append", choices=WORKLOADS, help="run this workload (repeatable)"
    )
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    names = ("ranks", "repeats", "heavy", "longest", "streams", "stream_tokens")
    for name in names:
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)}: at least 1")
    for name in ("batch", "also_batch"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)}: at least 1")
    for name in ("staggered", "burst"):
        if min(getattr(args, name)) < 1:
            p.error(f"--{name} {min(getattr(args, name))}: at least 1")
    if min(args.staggered_gap_ms) < 0:
        p.error(f"--staggered-gap-ms {min(args.staggered_gap_ms)}: not negative")
    args.workloads = tuple(args.only or WORKLOADS)
    if args.newcomer_after_s < 0:
        p.error(f"--newcomer-after-s {args.newcomer_after_s}: not negative")
    return args


def main() -> None:
    args = parse_args()
    from exokv.config import exokv_home
    from exokv.errors import ExokvError
    from exokv.model.resolve import resolve_model

    home = Path(tempfile.mkdtemp(prefix="serve-arrivals-"))
    source = exokv_home()
    if (source / "models").exists():
        (home / "models").symlink_to(source / "models", target_is_directory=True)
    os.environ["EXOKV_HOME"] = str(home)
    try:
        path = resolve_model(args.model)
    except ExokvError as err:
        raise SystemExit(f"serve_arrivals: {err}") from None
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    try:
        results = run(args, path, home, tokenizer)
    finally:
        shutil.rmtree(home, ignore_errors=True)
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(f"{args.ranks} rank(s); load average before {results['load_average_before']}")
    print(
        f"{'workload':<20} {'server':<10} {'mean TTFT':>10} {'p90 TTFT':>10} {'tok/s':>8} "
        f"{'longest pause':>14} {'CPU ms/tok':>10}"
    )
    for work in cases(args):
        for name, figs in results[work].items():
            for f in figs:
                pause = f["longest_pause_s"]
                shown = f"{pause * 1000:.0f} ms" if pause >= 0 else "-"
                print(
                    f"{work:<20} {name:<10} {f['ttft_mean_s']:>9.2f}s {f['ttft_p90_s']:>9.2f}s "
                    f"{f['tokens_per_s']:>8.1f} {shown:>14} "
                    f"{1000 * f['server_cpu_s'] / max(f['tokens'], 1):>10.2f}"
                )
    print(f"load average after {results['load_average_after']}")


def run(args: argparse.Namespace, path: Path, home: Path, tokenizer: Any) -> dict[str, Any]:
    from exokv.launch.command import launcher

    env = {**os.environ, "EXOKV_HOME": str(home)}
    ranks = args.ranks
    results: dict[str, Any] = {"model": args.model, "args": vars(args)}
    results["load_average_before"] = os.getloadavg()
    argv = [sys.executable, "-m", "exokv", "serve", "--model", args.model, "-n", str(ranks)]
    argv += ["--port", "{port}", "--disk-budget", "0"]
    also = [*argv, "--batch", str(args.also_batch)] if args.also_batch else []
    if args.batch is not None:
        argv += ["--batch", str(args.batch)]
    if ranks > 1:
        argv += ["--starting-port", str(args.starting_port)]
        if also:
            also += ["--starting-port", str(args.starting_port + 2 * base.PORT_BLOCK)]
    mlx_argv = [sys.executable, base.__file__, "--mlx-lm-probe"]
    mlx_argv += ["--model", str(path), "--port", "{port}", "--log-level", "INFO"]
    if ranks > 1:
        launch = [launcher(), "-n", str(ranks), "--backend", "ring"]
        launch += ["--starting-port", str(args.starting_port + base.PORT_BLOCK), "--"]
        mlx_argv = [*launch, *mlx_argv, "--pipeline"]
    probe_dir = home / "mlx-lm-probe"
    probe_dir.mkdir()
    started: list[base.Server] = []
    try:
        exokv = base.Server("exokv", argv, env, "serving ")
        started.append(exokv)
        mlx_env = {**env, base.PROBE_DIR: str(probe_dir)}
        mlx = base.Server("mlx_lm.server", mlx_argv, mlx_env, "Starting httpd", launched=ranks > 1)
        started.append(mlx)
        mlx.pause_when_idle = ranks > 1
        servers = {"exokv": (exokv, args.model), "mlx_lm": (mlx, "default_model")}
        if also:  # its own home: the two exokv servers do not share a store
            also_home = home / "also"
            also_home.mkdir()
            (also_home / "models").symlink_to(home / "models", target_is_directory=True)
            name = f"exokv-b{args.also_batch}"
            other = base.Server(name, also, {**env, "EXOKV_HOME": str(also_home)}, "serving ")
            started.append(other)
            servers[name] = (other, args.model)

        def only(server: base.Server) -> base.Server:
            return base.running_alone(server, servers)

        base.warm_up(servers)
        runs = cases(args)
        for work in runs:
            results[work] = {name: [] for name in servers}
        try:
            for trial in range(args.repeats):
                for work, workload in runs.items():
                    for name, (server, model) in servers.items():
                        cpu = cpu_seconds(server)
                        measured = workload(only(server), model, tokenizer, args, trial)
                        measured["server_cpu_s"] = cpu_seconds(server) - cpu
                        measured["load_average_1m"] = os.getloadavg()[0]
                        results[work][name].append(measured)
                        print(f"{work} {name}: {json.dumps(measured)}", file=sys.stderr)
        except Exception as err:  # a server that died mid-run: one line, exit 1
            done = {w: {n: len(r) for n, r in results[w].items()} for w in runs}
            raise SystemExit(
                f"serve_arrivals: the run failed in {work} on {name}: {err!r} (trials done: {done})"
            ) from None
    finally:
        for server in reversed(started):
            server.stop()
    results["load_average_after"] = os.getloadavg()
    return results


if __name__ == "__main__":
    main()
