"""Replicas, and a Mac that leaves: three ssh hosts on this machine, each with its own
sshd and home (tests/ssh_hosts.py `three_hosts_at`), pipeline ranks on all three.

1. Side by side, `--replicas 0` and `--replicas 1` alternating (`--repeat` runs each, a
   fresh disk tier on every host before each run): a chat of `--turns` turns, each line
   sent `--pause` seconds after the last reply (a user reading it; 0: at once, when a
   turn's copy is ended by the next turn and run again after it). Per run: the
   median TTFT of turns 2.., the replica bytes and seconds per turn, the disk used on
   the hosts (their kv folders) once the chat ended.
2. A host gone: the same chat with `--replicas 1`, host C taken away for good once the
   last turn's copies are done, one more turn: its cached share and TTFT (which holds
   the restarts' waits, 1 + 2 + 4 s, the re-plan and the new ranks' start) against the
   same turn with no cache on A and B (`--no-cache`: a cold prefill of the same prompt).

    python benchmarks/replicas.py [--model builtin:tiny] [--turns 4] [--repeat 3]
        [--words 150] [--pause 2] [--json FILE]
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

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))  # the hosts of the test suite

from ssh_hosts import THREE_HOSTS, ThreeHosts, three_hosts_at  # noqa: E402

WORDS = "sea wave ship sail harbour dusk wind salt rope deck tide storm gull light".split()


def hostfile(path: Path, names: list[str]) -> Path:
    path.write_text(json.dumps({"hosts": [{"ssh": n, "ips": [THREE_HOSTS[n]]} for n in names]}))
    return path


def lines(turns: int, words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(turns)]


def kv_bytes(hosts: ThreeHosts, name: str) -> int:
    return sum(p.stat().st_size for p in hosts.homes[name].rglob("kv/**/*.kv"))


def fresh_tiers(hosts: ThreeHosts) -> None:
    for home in hosts.homes.values():
        for kv in home.rglob("exokv/kv"):
            shutil.rmtree(kv, ignore_errors=True)


class ScriptChat:
    """`exokv chat --json` fed one line at a time."""

    def __init__(self, home: Path, hosts: ThreeHosts, model: str, *args: str) -> None:
        env = {
            **os.environ,
            "EXOKV_HOME": str(home),
            "PATH": f"{hosts.bin_dir}:{os.environ['PATH']}",
        }
        command = [sys.executable, "-m", "exokv", "chat", "-m", model, "--json", *args]
        self.proc = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
        )

    def send(self, line: str) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write((line + "\n").encode())
        self.proc.stdin.flush()
        out = self.proc.stdout.readline()
        if not out:
            raise RuntimeError(self.finish())
        return json.loads(out)

    def finish(self) -> str:
        assert self.proc.stdin is not None and self.proc.stderr is not None
        self.proc.stdin.close()
        self.proc.wait(300)
        return self.proc.stderr.read().decode()


def run_chat(
    hosts: ThreeHosts,
    work: Path,
    model: str,
    names: list[str],
    script: list[str],
    *args: str,
    pause: float = 0.0,
) -> tuple[ScriptChat, list[dict[str, Any]]]:
    port = str(30600 + random.randrange(0, 300) * 10)
    chat = ScriptChat(
        work / f"front-{time.monotonic_ns()}",
        hosts,
        model,
        *("--hostfile", str(hostfile(work / "hosts.json", names)), "--starting-port", port),
        *args,
    )
    turns = []
    for i, line in enumerate(script):
        if i and pause:
            time.sleep(pause)
        turns.append(chat.send(line))
    return chat, turns


def side_by_side(hosts: ThreeHosts, work: Path, opts: argparse.Namespace) -> list[dict[str, Any]]:
    three = ["exokv-a", "exokv-b", "exokv-c"]
    runs = []
    for rep in range(opts.repeat):
        for replicas in (0, 1) if rep % 2 == 0 else (1, 0):
            fresh_tiers(hosts)
            script = lines(opts.turns, opts.words, seed=rep)
            chat, turns = run_chat(
                hosts, work, opts.model, three, script, "--replicas", str(replicas),
                "--max-tokens", "16", pause=opts.pause,
            )  # fmt: skip
            chat.finish()
            copied = [t["replica_bytes"] for t in turns[1:]]
            runs.append(
                {
                    "replicas": replicas,
                    "ttft_s": statistics.median(t["ttft_s"] for t in turns[1:]),
                    "replica_bytes_per_turn": statistics.median(copied),
                    "replica_s_per_turn": statistics.median(t["replica_s"] for t in turns[1:]),
                    "disk_bytes": sum(kv_bytes(hosts, n) for n in three),
                }
            )
            print(json.dumps(runs[-1]), file=sys.stderr)
    return runs


def host_gone(hosts: ThreeHosts, work: Path, opts: argparse.Namespace) -> dict[str, Any]:
    fresh_tiers(hosts)
    script = [*lines(opts.turns, opts.words, seed=99), "And then?"]
    chat, turns = run_chat(
        hosts, work, opts.model, ["exokv-a", "exokv-b", "exokv-c"], script[:-1],
        "--max-tokens", "16", "--replicas", "1",
    )  # fmt: skip
    time.sleep(5.0)  # the last turn's copies (a few hundred ms here)
    hosts.gone("exokv-c")
    after = chat.send(script[-1])
    err = chat.finish()
    said = [x for x in err.splitlines() if "is gone" in x]
    cold_chat, cold = run_chat(
        hosts, work, opts.model, ["exokv-a", "exokv-b"], script, "--max-tokens", "16",
        "--no-cache",
    )  # fmt: skip
    cold_chat.finish()
    return {
        "said": said[0] if said else err.strip().splitlines()[-1:],
        "prompt_tokens": after["prompt_tokens"],
        "cached_tokens": after["cached_tokens"],
        "ttft_s_after_replan": after["ttft_s"],
        "ttft_s_cold_same_prompt": cold[-1]["ttft_s"],
        "reply_equal": after["reply"] == cold[-1]["reply"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:tiny")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--words", type=int, default=150)
    parser.add_argument("--pause", type=float, default=2.0)
    parser.add_argument("--json", dest="json_out")
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="exokv-replicas-") as tmp:
        work = Path(tmp)
        (work / "ssh").mkdir()
        with three_hosts_at(work / "ssh") as hosts:
            runs = side_by_side(hosts, work, opts)
            gone = host_gone(hosts, work, opts)
    summary: dict[str, Any] = {
        "model": opts.model,
        "turns": opts.turns,
        "words": opts.words,
        "pause_s": opts.pause,
    }
    for r in (0, 1):
        mine = [x for x in runs if x["replicas"] == r]
        summary[f"replicas_{r}"] = {
            k: statistics.median(x[k] for x in mine) for k in mine[0] if k != "replicas"
        }
    summary["ttft_ratio_1_over_0"] = round(
        summary["replicas_1"]["ttft_s"] / summary["replicas_0"]["ttft_s"], 3
    )
    summary["host_gone"] = gone
    summary["runs"] = runs
    text = json.dumps(summary, indent=1)
    print(text)
    if opts.json_out:
        Path(opts.json_out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
