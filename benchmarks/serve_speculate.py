"""`exokv serve` batch rows with drafts against `--no-speculate` (issue 46, item 3).

    python benchmarks/serve_speculate.py --model builtin:base --repeats 3 --json
    python benchmarks/serve_speculate.py --model smollm2 --weights float16 --repeats 3 --json

Two servers on the same model, both up at once, each in its own home, measured in
turn (trials alternate, so a shared machine's noise falls on both alike): one as
`exokv serve` starts, one with `--no-speculate`. A trial is --streams requests at
once through the `openai` client, each "Repeat this text exactly, word for word:"
and a paragraph of its own (about 60 words), --max-tokens tokens at temperature 0:
the batch's rows quote their prompts, the case drafts from the prompt exist for.
Aggregate tokens/s = all completion tokens / the wall time from the first request
to the last token. Reported: medians of --repeats, their ratio, and whether every
reply was the same on both servers (it must be: temperature 0).

A server that does not start ends the script with one line and exit 1.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serve_vs_mlx_lm as base  # noqa: E402 - its Server and its streamed turn

PARAGRAPHS = [
    "The harbour was quiet before dawn. Fishing boats rocked against the old stone wall, "
    "their ropes creaking in the cold wind, while a single lamp burned in the harbour "
    "master's window. By six the first crews arrived, carrying nets and flasks of tea, "
    "and the gulls began to circle above the market where the day's catch would be sold.",
    "Our team moved the build servers to a new rack last week. The old machines were slow "
    "and often ran out of disk space during long test runs. The new ones have more memory, "
    "faster drives and a shared cache, so a full build now takes twelve minutes instead of "
    "forty, and nobody has to restart a failed job by hand any more.",
    "In the spring the village holds a fair on the green behind the church. Farmers bring "
    "lambs and early vegetables, children race wooden boats on the pond, and the bakery "
    "sells bread shaped like animals. In the evening a band plays under the oak tree and "
    "everyone stays out until the light fades over the hills to the west.",
    "The library opens at nine and closes at eight on weekdays. Members may borrow up to "
    "ten books for three weeks and renew them twice online. Quiet rooms on the second floor "
    "can be booked for two hours at a time, and the reading room keeps newspapers from "
    "every region of the country, including the small local ones.",
    "To make the soup, soften two onions in butter, add three diced potatoes and a litre "
    "of stock, and simmer for twenty minutes. Stir in a handful of chopped leeks, season "
    "with salt and pepper, and blend until smooth. Serve it hot with fresh bread, a little "
    "cream on top and some chives cut finely with scissors.",
    "The train left the city at noon and followed the river north through wide fields of "
    "wheat. At each small station a few people got off with bags of shopping, and the "
    "conductor waved to the farmers he knew. After two hours the hills grew steeper, the "
    "track climbed into the forest and the air in the carriage turned cool.",
    "Please check the following before you submit a change: the tests pass on your "
    "machine, the code is formatted, every new function has a short comment that says why "
    "it exists, and the description of the change names the issue it fixes. A reviewer "
    "will answer within two working days, usually much sooner than that.",
    "The museum's new wing holds paintings from the last two centuries, arranged by the "
    "towns where they were made rather than by painter. Visitors walk from the coast to "
    "the mountains, room by room, and see how the same valley was painted in summer and "
    "winter, by day and by night, by artists who never met one another.",
]


def prompts(streams: int) -> list[list[dict]]:
    return [
        [
            {
                "role": "user",
                "content": "Repeat this text exactly, word for word: "
                + PARAGRAPHS[i % len(PARAGRAPHS)],
            }
        ]
        for i in range(streams)
    ]


def trial(server: base.Server, model: str, streams: int, max_tokens: int) -> dict[str, Any]:
    with ThreadPoolExecutor(streams) as pool:
        runs = list(
            pool.map(lambda m: base.stream_turn(server, model, m, max_tokens), prompts(streams))
        )
    wall = max(r["end"] for r in runs) - min(r["sent"] for r in runs)
    tokens = sum(r["tokens"] for r in runs)
    return {"tokens_per_s": tokens / wall, "tokens": tokens, "replies": [r["text"] for r in runs]}


def drafts_kept(server: base.Server) -> list[str]:
    """The access log's drafts=kept/drafted of every answered request."""
    return [part for line in server.log for part in line.split() if part.startswith("drafts=")]


def parse_args(argv: list[str] | None = None, doc: str | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(doc or __doc__).split("\n\n")[0])
    p.add_argument("--model", default="builtin:base")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=80)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--weights",
        choices=("converted", "float16"),
        default="converted",
        help="float16: the model dequantized, made once as speculate.py makes it",
    )
    p.add_argument("--float16-dir", type=Path, default=Path(tempfile.gettempdir()) / "exokv-bench")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.weights == "float16":
        from speculate import float16_copy  # deferred: it loads the engine's modules

        args.model = float16_copy(args.model, args.float16_dir)
    return args


def run(args: argparse.Namespace, home: Path) -> dict[str, Any]:
    results: dict[str, Any] = {"model": args.model, "args": vars(args)}
    results["load_average_before"] = os.getloadavg()
    argv = [sys.executable, "-m", "exokv", "serve", "--model", args.model]
    argv += ["--port", "{port}", "--disk-budget", "0", "--batch", str(args.streams)]
    servers: dict[str, base.Server] = {}
    try:
        for name, extra in (("speculate", []), ("no-speculate", ["--no-speculate"])):
            own = home / name
            own.mkdir()
            (own / "models").symlink_to(home / "models", target_is_directory=True)
            env = {**os.environ, "EXOKV_HOME": str(own)}
            servers[name] = base.Server(name, [*argv, *extra], env, "serving ")
        base.warm_up({n: (s, args.model) for n, s in servers.items()})
        runs: dict[str, list[dict]] = {name: [] for name in servers}
        for t in range(args.repeats):
            for name, server in servers.items():
                runs[name].append(trial(server, args.model, args.streams, args.max_tokens))
                shown = {k: v for k, v in runs[name][-1].items() if k != "replies"}
                print(f"trial {t} {name}: {json.dumps(shown)}", file=sys.stderr)
        results["drafts"] = drafts_kept(servers["speculate"])
    finally:
        for server in servers.values():
            server.stop()
    for name, trials in runs.items():
        results[name] = {
            "tokens_per_s": [round(r["tokens_per_s"], 1) for r in trials],
            "median_tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in trials), 1),
            "tokens": [r["tokens"] for r in trials],
        }
    medians = [results[n]["median_tokens_per_s"] for n in ("speculate", "no-speculate")]
    results["ratio"] = round(medians[0] / medians[1], 2)
    results["same_replies"] = all(
        a["replies"] == b["replies"]
        for a, b in zip(runs["speculate"], runs["no-speculate"], strict=True)
    )
    results["load_average_after"] = os.getloadavg()
    return results


def main() -> None:
    args = parse_args()
    from exokv.config import exokv_home

    home = Path(tempfile.mkdtemp(prefix="serve-speculate-"))
    source = exokv_home() / "models"  # the models already generated or fetched there
    source.mkdir(parents=True, exist_ok=True)
    (home / "models").symlink_to(source, target_is_directory=True)
    try:
        results = run(args, home)
    finally:
        shutil.rmtree(home, ignore_errors=True)
    if args.json:
        print(json.dumps(results, indent=2))
        return
    for name in ("speculate", "no-speculate"):
        r = results[name]
        print(f"{name:<13} median {r['median_tokens_per_s']:>7.1f} tok/s  runs {r['tokens_per_s']}")
    print(f"ratio {results['ratio']}x, same replies: {results['same_replies']}")
    before, after = results["load_average_before"], results["load_average_after"]
    print(f"load average before {before}, after {after}")


if __name__ == "__main__":
    main()
