"""Per zoo family: cache kind, cache bytes per token on each of two pipeline ranks, and
the cached fraction of a 4-turn chat.

    python benchmarks/zoo.py [--ranks 2] [--starting-port 27300] [--json]

Each family runs one 4-turn script-mode chat (`exokv chat --model builtin:<f>-tiny
-n 2 --json --max-tokens 8`) in a fresh EXOKV_HOME. Bytes per token per rank come
from the turns' `add` events (bytes on each rank / tokens added); `cache bytes` is
each rank's prefix cache after the last turn; the cached fraction is the prompt
tokens served from the cache over all prompt tokens of the 4 turns.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from exokv.model import zoo
from exokv.model.families import describe

TURNS = [
    "Hello there, tell me about the weather in Paris today",
    "And what about tomorrow in London?",
    "Is it sunny there in the spring, or does it rain a lot?",
    "Thank you for your help!",
]


def run_family(family: str, ranks: int, port: int, models: Path) -> dict[str, Any]:
    home = Path(tempfile.mkdtemp(prefix="exokv-zoo-"))
    (home / "models").symlink_to(models, target_is_directory=True)
    args = ["--model", f"builtin:{family}-tiny", "--json", "--max-tokens", "8"]
    if ranks > 1:
        args += ["-n", str(ranks), "--starting-port", str(port)]
    proc = subprocess.run(
        [sys.executable, "-m", "exokv", "chat", *args],
        input="\n".join(TURNS) + "\n",
        capture_output=True,
        text=True,
        env={**os.environ, "EXOKV_HOME": str(home)},
        timeout=300,
    )
    if proc.returncode:
        return {"family": family, "error": proc.stderr.strip()}
    turns = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    added = [e for t in turns for e in t["events"] if e["kind"] == "add" and e["tokens"]]
    tokens = sum(e["tokens"] for e in added)
    per_rank = [sum(e["bytes"][r] for e in added) / tokens for r in range(ranks)]
    prompt = sum(t["prompt_tokens"] for t in turns)
    return {
        "family": family,
        "cache_kind": describe(zoo.zoo_config(f"{family}-tiny"))["cache_kind"],
        "bytes_per_token": [round(b) for b in per_rank],
        "cache_bytes": turns[-1]["cache_bytes"],
        "cached_fraction": round(sum(t["cached_tokens"] for t in turns) / prompt, 3),
        "cached_tokens": [t["cached_tokens"] for t in turns],
        "prompt_tokens": [t["prompt_tokens"] for t in turns],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--starting-port", type=int, default=27300)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    models = Path(tempfile.mkdtemp(prefix="exokv-zoo-models-"))
    os.environ["EXOKV_HOME"] = str(models)
    for name in zoo.zoo_names():
        zoo.ensure_zoo(name)
    rows = [
        run_family(f, args.ranks, args.starting_port + 10 * i, models / "models")
        for i, f in enumerate(zoo.FAMILIES)
    ]
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"{'family':<12} {'cache':<9} {'B/token per rank':<18} {'cache bytes':<18} cached")
    for row in rows:
        if "error" in row:
            print(f"{row['family']:<12} error: {row['error']}")
            continue
        bpt = " / ".join(map(str, row["bytes_per_token"]))
        held = " / ".join(map(str, row["cache_bytes"]))
        print(
            f"{row['family']:<12} {row['cache_kind']:<9} {bpt:<18} {held:<18} "
            f"{row['cached_fraction']:.1%}"
        )


if __name__ == "__main__":
    main()
