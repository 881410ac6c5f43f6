"""Speculation in a fresh chat's first reply (issue 46): `exokv chat` started anew for
every run, as `echo PROMPT | exokv chat` is, with and without `--no-speculate`.

    python benchmarks/speculate_first_turn.py --weights converted,float16 \
        --cases free,repeat --repeat 3 [--ranks 2] [--baseline DIR] [--json]

`benchmarks/speculate.py` keeps one engine for all its turns, so only its first turn
starts with nothing measured; here every run does, which is where a draft chooser pays
to learn what a pass costs. The prompts are speculate.py's (`repeat` quotes a paragraph,
`free` writes a story), 80 tokens at temperature 0, without the cache. Each repeat runs
every (weights, case) in each variant, the order alternating: `speculate` (this
checkout), `plain` (`--no-speculate`) and, with `--baseline DIR` (another checkout of
exokv, e.g. `git worktree add DIR REV`), `baseline` (that code, speculating). Ratios
are over the plain run of the same repeat; medians; replies must be identical.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from speculate import CASES, float16_copy


def run(model: str, prompt: str, variant: str, args: argparse.Namespace) -> dict[str, Any]:
    """One fresh chat of one turn; its JSON line."""
    env = dict(os.environ, EXOKV_HOME=tempfile.mkdtemp(prefix="exokv-first-"))
    cmd = [sys.executable, "-m", "exokv", "chat", "--model", model, "--json", "--no-cache"]
    cmd += ["--max-tokens", str(args.max_tokens), "--temp", "0"]
    if args.ranks > 1:
        cmd += ["-n", str(args.ranks), "--starting-port", str(args.starting_port)]
    if variant == "plain":
        cmd.append("--no-speculate")
    if variant == "baseline":
        env["PYTHONPATH"] = str(args.baseline)  # its exokv package comes first
    # Run from a neutral folder: `python -m` puts the working folder first on sys.path,
    # before PYTHONPATH, so a checkout as working folder would shadow the baseline.
    done = subprocess.run(
        cmd,
        input=prompt + "\n",
        capture_output=True,
        text=True,
        env=env,
        cwd=tempfile.gettempdir(),
        timeout=900,
    )
    turns = [json.loads(x) for x in done.stdout.splitlines() if x.startswith("{")]
    if done.returncode != 0 or not turns:
        raise SystemExit(f"{variant}: exokv chat failed: {done.stderr.strip()[-400:]}")
    return turns[-1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--weights", default="converted", help="comma separated: converted,float16")
    p.add_argument("--cases", default="free,repeat", help="comma separated: free,repeat")
    p.add_argument("--max-tokens", type=int, default=80)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--ranks", type=int, default=1, help="pipeline ranks")
    p.add_argument("--starting-port", type=int, default=34100)
    p.add_argument("--baseline", type=Path, help="another exokv checkout to compare")
    p.add_argument("--float16-dir", type=Path, default=Path(tempfile.gettempdir()) / "exokv-bench")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    variants = ["speculate", "plain"] + (["baseline"] if args.baseline else [])
    models = {
        w: float16_copy(args.model, args.float16_dir) if w == "float16" else args.model
        for w in args.weights.split(",")
    }
    runs: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for i in range(args.repeat):
        for weights, model in models.items():
            for case in args.cases.split(","):
                for variant in variants if i % 2 == 0 else variants[::-1]:
                    turn = run(model, CASES[case], variant, args)
                    runs.setdefault((weights, case, variant), []).append(turn)
                    why = turn.get("speculation_detail", {}).get("why")
                    print(weights, case, variant, turn["decode_tps"], why, file=sys.stderr)
    rows = []
    for (weights, case, variant), turns in sorted(runs.items()):
        plain = runs[(weights, case, "plain")]
        ratios = [t["decode_tps"] / q["decode_tps"] for t, q in zip(turns, plain, strict=True)]
        rows.append(
            {
                "weights": weights,
                "case": case,
                "variant": variant,
                "ranks": args.ranks,
                "decode_tps": statistics.median(t["decode_tps"] for t in turns),
                "ratio": statistics.median(ratios),
                "pairs": [round(r, 3) for r in ratios],
                "same_reply": all(
                    t["reply"] == q["reply"] for t, q in zip(turns, plain, strict=True)
                ),
                "why": [t.get("speculation_detail", {}).get("why") for t in turns],
            }
        )
    if args.json:
        print(json.dumps({"rows": rows}, indent=1))
        return
    print("| weights | case | variant | ranks | tok/s | ratio | pairs | same reply |")
    print("| --- | --- | --- | ---: | ---: | ---: | --- | --- |")
    for r in rows:
        pairs = ", ".join(f"{x:.3f}" for x in r["pairs"])
        print(
            f"| {r['weights']} | {r['case']} | {r['variant']} | {r['ranks']} | "
            f"{r['decode_tps']:.2f} | {r['ratio']:.3f}x | {pairs} | {r['same_reply']} |"
        )


if __name__ == "__main__":
    main()
