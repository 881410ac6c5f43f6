"""Weights lent to a host that lacks them: three ssh hosts on this machine, each with its
own sshd and home (tests/ssh_hosts.py `three_hosts_at`), no ranks.

A model folder given as `~/models/NAME` is in the homes of A, B and this machine, not
in C's. `exokv.hosts.fetch.fetch_onto_hosts` (what a chat runs before its ranks start,
and again at every re-plan) is timed, alternating, `--repeat` times each:
- `lent`: C's folder removed first, so C is lent its layers' files (split 2,1,1: C
  runs layer 0) from A; the bytes and seconds the copy line says, and the whole call;
- `held`: every host already holds its files: the check alone, what a folder model
  now costs every start on several hosts.

Two models: llama-tiny (the suite's, one shard per layer, 1.1 MB) and a folder of the
same layout with `--shard-mb` MB of random data per shard (the stream's throughput).

    python benchmarks/weights_lent.py [--repeat 5] [--shard-mb 64] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))  # the hosts and the model of the test suite

from hub_standin import build_repo  # noqa: E402
from ssh_hosts import ThreeHosts, three_hosts_at  # noqa: E402

from exokv.hosts.fetch import fetch_onto_hosts  # noqa: E402
from exokv.hosts.hostfile import Host, HostList  # noqa: E402

SPLIT = [2, 1, 1]


def padded(src: Path, out: Path, shard_mb: int) -> Path:
    """`src` with each layer's shard grown by `shard_mb` MB of random data in one more
    tensor (the index says so): the same layout, weights of a real size."""
    shutil.copytree(src, out)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    for shard in sorted(set(index["weight_map"].values())):
        path = out / shard
        data = path.read_bytes()
        (length,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + length])
        end = max(t["data_offsets"][1] for k, t in header.items() if k != "__metadata__")
        extra = shard_mb * 2**20
        name = f"pad.{shard}"
        header[name] = {"dtype": "U8", "shape": [extra], "data_offsets": [end, end + extra]}
        raw = json.dumps(header).encode()
        body = data[8 + length :]
        path.write_bytes(len(raw).to_bytes(8, "little") + raw + body + os.urandom(extra))
    return out


def one(hosts: ThreeHosts, model_name: str, lent: bool) -> dict[str, Any]:
    if lent:
        shutil.rmtree(hosts.homes["exokv-c"] / "models", ignore_errors=True)
    said: list[str] = []
    listed = HostList([Host(n) for n in ("exokv-a", "exokv-b", "exokv-c")])
    started = time.monotonic()
    fetch_onto_hosts(f"~/models/{model_name}", listed, SPLIT, "pipeline", say=said.append)
    total = time.monotonic() - started
    copied = [x for x in said if x.startswith("weights: ")]
    assert bool(copied) == lent, said
    bytes_ = sum(p.stat().st_size for p in (hosts.homes["exokv-c"] / "models").rglob("*"))
    seconds = float(copied[0].rsplit(" in ", 1)[1].removesuffix(" s")) if copied else 0.0
    return {"call_s": total, "copy_s": seconds, "bytes_on_c": bytes_, "line": copied}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--shard-mb", type=int, default=64)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    results: dict[str, Any] = {"load": os.getloadavg(), "commit": _commit()}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        (tmp / "ssh").mkdir()
        with three_hosts_at(tmp / "ssh") as hosts:
            measure(hosts, tmp, args, results)
    results["load_after"] = os.getloadavg()
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))


def measure(
    hosts: ThreeHosts, tmp: Path, args: argparse.Namespace, results: dict[str, Any]
) -> None:
    tiny = build_repo(tmp / "llama-tiny")
    big = padded(tiny, tmp / f"llama-tiny-{args.shard_mb}mb", args.shard_mb)
    os.environ["PATH"] = f"{hosts.bin_dir}:{os.environ['PATH']}"
    front = tmp / "front-home"
    os.environ["HOME"] = str(front)
    for model in (tiny, big):
        for home in (front, hosts.homes["exokv-a"], hosts.homes["exokv-b"]):
            shutil.copytree(model, home / "models" / model.name)
    for model in (tiny, big):
        runs: dict[str, list[dict[str, Any]]] = {"lent": [], "held": []}
        for _ in range(args.repeat):
            for kind in ("lent", "held"):
                runs[kind].append(one(hosts, model.name, kind == "lent"))
        lent, held = runs["lent"], runs["held"]
        summary = {
            "bytes_copied": lent[0]["bytes_on_c"],
            "copy_s_median": statistics.median(r["copy_s"] for r in lent),
            "call_s_median_lent": statistics.median(r["call_s"] for r in lent),
            "call_s_median_held": statistics.median(r["call_s"] for r in held),
            "line": lent[0]["line"][0],
        }
        summary["mb_per_s"] = summary["bytes_copied"] / 1e6 / summary["copy_s_median"]
        results[model.name] = {"summary": summary, "runs": runs}
        print(model.name, json.dumps(summary, indent=1), flush=True)


def _commit() -> str:
    done = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE
    )
    return done.stdout.strip()


if __name__ == "__main__":
    main()
