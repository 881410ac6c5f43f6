"""Enter on /quit to process exit, with a RAM cache of a few hundred MB: this checkout
(every turn written through to the disk tier) against an earlier revision (by default
where this branch left main), which writes what RAM holds at quit.

    python benchmarks/quit.py --model builtin:base --sessions 12 --words 3000 --repeats 3

1. Once: a script-mode chat (this checkout) of --sessions sessions, one message of
   --words words each (about 2.6 tokens a word on builtin:base), then quits: the disk
   tier holds every session.
2. Each trial copies that EXOKV_HOME and starts `exokv chat --json` (script mode); for
   each session it sends `/switch sK` and a short line, whose turn loads the session's
   KV from disk, so RAM then holds the whole chat (the last turn's `cache_bytes` is
   reported). Then it sends `/quit` and Enter and measures the time until the process
   has exited. "now" trials run this checkout; "before" trials the baseline revision's
   `exokv` (extracted with `git archive`, first on PYTHONPATH). Trials alternate so
   machine noise hits both alike. Replies must be equal in both (checked).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

WORDS = (
    "river stone light window garden paper music winter orange signal harbor "
    "forest bridge candle thunder silver meadow lantern compass feather"
).split()
REPO = Path(__file__).resolve().parent.parent


def chat(home: Path, model: str, path: str | None) -> subprocess.Popen[bytes]:
    env = {**os.environ, "EXOKV_HOME": str(home)}
    env.pop("EXOKV_DEBUG", None)
    if path is not None:
        env["PYTHONPATH"] = path
    return subprocess.Popen(
        [sys.executable, "-m", "exokv", "chat", "--model", model, "--json", "--max-tokens", "4"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        cwd=tempfile.gettempdir(),  # not this checkout: -m exokv must find the one asked for
    )


def send(proc: subprocess.Popen[bytes], line: str) -> dict[str, Any]:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write((line + "\n").encode())
    proc.stdin.flush()
    out = proc.stdout.readline()
    if not out:
        raise SystemExit(f"the chat ended: {proc.stderr.read().decode() if proc.stderr else ''}")
    return json.loads(out)


def build(home: Path, model: str, sessions: int, words: int) -> None:
    rng = random.Random(0)
    lines = []
    for k in range(sessions):
        lines += [f"/new s{k}", " ".join(rng.choice(WORDS) for _ in range(words))]
    proc = chat(home, model, None)
    for line in lines:
        doc = send(proc, line)
        if "turn" in doc:
            print(f"  setup: {doc['session']} {doc['prompt_tokens']:,} tokens", file=sys.stderr)
    _, err = proc.communicate(b"/quit\n", timeout=600)
    if proc.returncode != 0:
        raise SystemExit(err.decode())


def trial(base: Path, work: Path, model: str, sessions: int, mode: str, path: str | None):
    home = work / mode
    shutil.rmtree(home, ignore_errors=True)
    shutil.copytree(base, home, symlinks=True)
    proc = chat(home, model, path)
    turns = []
    for k in range(sessions):
        send(proc, f"/switch s{k}")
        turns.append(send(proc, "Go on."))
    enter = time.perf_counter()
    _, err = proc.communicate(b"/quit\n", timeout=600)
    quit_s = time.perf_counter() - enter
    if proc.returncode != 0:
        raise SystemExit(err.decode())
    return {
        "mode": mode,
        "quit_s": quit_s,
        "ram_bytes": turns[-1]["rank_stats"][0]["cache_bytes"],
        "cached_tokens": sum(t["cached_tokens"] for t in turns),
        "replies": [t["reply"] for t in turns],
    }


def baseline_tree(rev: str, into: Path) -> str:
    """The baseline revision's `exokv` package, extracted; returns the path to put first."""
    if rev == "merge-base":
        rev = subprocess.run(
            ["git", "-C", str(REPO), "merge-base", "HEAD", "main"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", rev, "exokv"], capture_output=True, check=True
    ).stdout
    into.mkdir(parents=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return rev


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="builtin:base")
    ap.add_argument("--sessions", type=int, default=12)
    ap.add_argument("--words", type=int, default=3000, help="words in each session's message")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--baseline", default="merge-base", help="git revision to compare with")
    ap.add_argument("--base", help="keep the built chat in this folder; reuse it if there")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="exokv-quit-"))
    try:
        rev = baseline_tree(args.baseline, work / "baseline")
        base = Path(args.base) if args.base else work / "base"
        if not (base / "built").exists():
            shutil.rmtree(base, ignore_errors=True)
            base.mkdir(parents=True)
            build(base, args.model, args.sessions, args.words)
            (base / "built").write_text(f"{args.model} {args.sessions} {args.words}\n")
        trials = []
        for _ in range(args.repeats):
            for mode, path in (("now", None), ("before", str(work / "baseline"))):
                trials.append(trial(base, work, args.model, args.sessions, mode, path))
                t = trials[-1]
                print(
                    f"  {mode:6} RAM {t['ram_bytes'] / 1e6:.0f} MB, /quit to exit "
                    f"{t['quit_s']:.3f} s",
                    file=sys.stderr,
                )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if len({json.dumps(t["replies"]) for t in trials}) != 1:
        raise SystemExit("the replies differ between the two revisions: not comparable")
    summary = {
        mode: {
            key: statistics.median(t[key] for t in trials if t["mode"] == mode)
            for key in ("quit_s", "ram_bytes", "cached_tokens")
        }
        for mode in ("now", "before")
    }
    doc = {
        "model": args.model,
        "baseline": rev,
        "repeats": args.repeats,
        "summary": summary,
        "trials": [{k: v for k, v in t.items() if k != "replies"} for t in trials],
    }
    if args.json:
        print(json.dumps(doc, indent=2))
        return
    print(f"{args.model}, baseline {rev[:10]}, median of {args.repeats} trials each")
    print(f"{'code':8} {'RAM cache':>10} {'cached tokens':>14} {'/quit to exit':>14}")
    for mode, s in summary.items():
        print(
            f"{mode:8} {s['ram_bytes'] / 1e6:>7.0f} MB {s['cached_tokens']:>14,} "
            f"{s['quit_s']:>12.3f} s"
        )


if __name__ == "__main__":
    main()
