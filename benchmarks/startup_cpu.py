"""Where a multi-rank chat's start-up CPU goes: every process of the chat, sampled.

    python benchmarks/startup_cpu.py --model builtin:llama-tiny --ranks 2 --repeats 5 \
        --baseline e0a0ca9

Each trial runs a script-mode chat (`exokv chat --json`, two short turns) on --ranks
ranks of this machine and samples its process tree every 50 ms with psutil: each
process's CPU seconds (user + system) at its last sample, grouped as front end,
launcher (mlx.launch), ranks and watchers. With --baseline, trials alternate between
this checkout and that revision's `exokv` (extracted with `git archive`, first on
PYTHONPATH), so the machine's noise falls on both alike. Medians are reported; the
replies must be equal in both (checked).
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

import psutil
from quit import baseline_tree

LINES = ["Hello there, tell me about the weather in Paris today", "And in Rome?"]
GROUPS = ("front end", "launcher", "ranks", "watchers")


def group(cmdline: list[str]) -> str:
    text = " ".join(cmdline)
    if "mlx.launch" in text:
        return "launcher"
    if "exokv.launch.watcher" in text:
        return "watchers"
    if "exokv.rank" in text:
        return "ranks"
    return "front end" if "exokv" in text else "other"


def trial(model: str, ranks: int, port: int, path: str | None, models: Path) -> dict[str, Any]:
    """One chat start and its two turns: CPU seconds per group, wall seconds, replies.
    A fresh EXOKV_HOME each time (nothing cached), its models those in `models`."""
    home = Path(tempfile.mkdtemp(prefix="exokv-startup-"))
    (home / "models").symlink_to(models, target_is_directory=True)
    env = {**os.environ, "EXOKV_HOME": str(home)}
    if path is not None:
        env["PYTHONPATH"] = path + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-m", "exokv", "chat", "--model", model, "--json"]
    cmd += ["--max-tokens", "8", "-n", str(ranks), "--starting-port", str(port)]
    start = time.monotonic()
    proc = subprocess.Popen(
        cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
    )
    assert proc.stdin is not None
    proc.stdin.write(("\n".join(LINES) + "\n").encode())
    proc.stdin.close()
    root = psutil.Process(proc.pid)
    seen: dict[int, tuple[str, float]] = {}  # pid -> (group, CPU seconds at its last sample)
    while proc.poll() is None:
        try:
            tree = [root, *root.children(recursive=True)]
        except psutil.Error:
            break
        for p in tree:
            try:
                times = p.cpu_times()
                seen[p.pid] = (
                    seen.get(p.pid, (group(p.cmdline()), 0.0))[0],
                    times.user + times.system,
                )
            except psutil.Error:
                pass
        time.sleep(0.05)
    assert proc.stdout is not None
    out = proc.stdout.read().decode()
    proc.wait()
    if proc.returncode != 0:
        raise SystemExit(f"startup_cpu: the chat exited with {proc.returncode}")
    cpu = dict.fromkeys(GROUPS, 0.0)
    for name, seconds in seen.values():
        if name in cpu:
            cpu[name] += seconds
    replies = [json.loads(x)["reply"] for x in out.splitlines() if '"turn"' in x]
    return {"wall_s": time.monotonic() - start, "cpu_s": cpu, "replies": replies}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="builtin:llama-tiny")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--baseline", default=None, help="a revision to alternate with")
    ap.add_argument("--starting-port", type=int, default=31400)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    codes: dict[str, str | None] = {"now": None}
    with tempfile.TemporaryDirectory() as scratch:
        if args.baseline:
            rev = baseline_tree(args.baseline, Path(scratch) / "before")
            codes[f"before ({rev[:7]})"] = str(Path(scratch) / "before")
        models = Path(scratch) / "home" / "models"
        warm = {**os.environ, "EXOKV_HOME": str(models.parent)}  # a builtin is made once
        subprocess.run(
            [sys.executable, "-m", "exokv", "chat", "--model", args.model, "--json"],
            input=b"",
            env=warm,
            capture_output=True,
            check=True,
        )
        trials: dict[str, list[dict[str, Any]]] = {name: [] for name in codes}
        for _ in range(args.repeats):
            for name, path in codes.items():
                run = trial(args.model, args.ranks, args.starting_port, path, models)
                trials[name].append(run)
    replies = {json.dumps(t["replies"]) for runs in trials.values() for t in runs}
    if len(replies) != 1:
        raise SystemExit(f"startup_cpu: the replies differ between trials: {replies}")
    doc = {
        "model": args.model,
        "ranks": args.ranks,
        "repeats": args.repeats,
        "load_average": os.getloadavg(),
        "codes": {
            name: {
                "median_wall_s": round(statistics.median(t["wall_s"] for t in runs), 3),
                "median_cpu_s": {
                    g: round(statistics.median(t["cpu_s"][g] for t in runs), 3) for g in GROUPS
                },
                "trials": runs,
            }
            for name, runs in trials.items()
        },
    }
    if args.json:
        print(json.dumps(doc, indent=2))
        return
    print(f"{args.model} on {args.ranks} ranks, {args.repeats} trials, medians (CPU seconds):")
    print(f"{'code':<20} {'wall':>6} " + " ".join(f"{g:>10}" for g in GROUPS))
    for name, entry in doc["codes"].items():
        cpu = entry["median_cpu_s"]
        row = " ".join(f"{cpu[g]:>10.2f}" for g in GROUPS)
        print(f"{name:<20} {entry['median_wall_s']:>6.2f} {row}")


if __name__ == "__main__":
    main()
