"""Two pipeline ranks against one: Ctrl-C in a long prefill, the bar's wait, the first TTFT.

    python benchmarks/two_rank_stop.py --model smollm2 --rounds 2 --stops 5

Issue 45. Each round starts the real REPL (`exokv chat`, in a pseudo-terminal, typing
ahead on, a fresh state directory) on one rank, then on two (`-n 2`, pipeline), so the
two run side by side at the same load, and in each:

1. the first turn: a short line typed, --pause seconds, Enter; the status line's TTFT
   (nothing is cached yet: the whole template and line are prefilled);
2. --stops times: a bracketed paste of about --paste-tokens tokens (different each
   time), Enter, Ctrl-C --stop-after seconds later; the time from Ctrl-C to "stopped
   before the reply began" on the terminal, and from Enter to the prefill bar.

Prints medians over all rounds, with `uptime`'s load before and after (the machine is
shared: the figures move with it).
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
from pathlib import Path
from typing import Any

from prefill_stop import BAR, FIRST, STOPPED, _maybe, _seconds, _until
from resume import STATUS, Trial
from typeahead import paste_text


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _wait(trial: Trial, seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        trial._read(0.01)


def run_chat(home: Path, args: argparse.Namespace, ranks: int) -> dict[str, Any]:
    extra = ["--ranks", str(ranks), "--starting-port", str(args.starting_port)] if ranks > 1 else []
    trial = Trial(home, args.model, args.max_tokens, *extra)
    trial.wait_for(r"demo › ", timeout=900)
    out: dict[str, Any] = {"ranks": ranks, "load_before": _load()}
    mark = len(trial.raw)
    os.write(trial.fd, FIRST.encode())
    _wait(trial, args.pause)
    os.write(trial.fd, b"\r")
    status = trial.wait_for(STATUS.pattern, start=mark)
    out["first_ttft_s"] = _seconds(status)
    out["first_prompt_tokens"] = int(status.group(1).replace(",", ""))
    trial.wait_for(r"demo › ", start=len(trial.raw) - 200)
    out["stops"] = []
    for i in range(args.stops):
        paste = f"Note {i}: " + paste_text(args.paste_tokens)
        os.write(trial.fd, b"\x1b[200~" + paste.encode() + b"\x1b[201~")
        _wait(trial, 0.3)
        after_paste = len(trial.raw)
        os.write(trial.fd, b"\r")
        enter = time.perf_counter()
        _wait(trial, args.stop_after)
        os.write(trial.fd, b"\x03")
        ctrl_c = time.perf_counter()
        stopped = _until(trial, STOPPED, after_paste)
        bar = _maybe(trial, BAR, after_paste)
        out["stops"].append(
            {
                "ctrl_c_to_turn_end_s": round(stopped - ctrl_c, 3),
                "enter_to_bar_s": None if bar is None else round(bar - enter, 3),
            }
        )
        trial.wait_for(r"demo › ", start=len(trial.raw) - 200)
    out["load_after"] = _load()
    trial.quit()
    return out


def _median(values: list[float]) -> float:
    return round(statistics.median(values), 3) if values else float("nan")


def summary(runs: list[dict[str, Any]], ranks: int) -> dict[str, Any]:
    mine = [r for r in runs if r["ranks"] == ranks]
    stops = [s for r in mine for s in r["stops"]]
    bars = [s["enter_to_bar_s"] for s in stops if s["enter_to_bar_s"] is not None]
    return {
        "ranks": ranks,
        "first_ttft_s": [r["first_ttft_s"] for r in mine],
        "first_ttft_median_s": _median([r["first_ttft_s"] for r in mine]),
        "ctrl_c_to_turn_end_s": [s["ctrl_c_to_turn_end_s"] for s in stops],
        "ctrl_c_median_s": _median([s["ctrl_c_to_turn_end_s"] for s in stops]),
        "ctrl_c_max_s": max((s["ctrl_c_to_turn_end_s"] for s in stops), default=float("nan")),
        "enter_to_bar_median_s": _median(bars),
        "enter_to_bar_max_s": max(bars, default=float("nan")),
        "bars_shown": f"{len(bars)}/{len(stops)}",
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--rounds", type=int, default=2, help="chats per rank count, alternating")
    ap.add_argument("--stops", type=int, default=5, help="Ctrl-C's per chat")
    ap.add_argument("--paste-tokens", type=int, default=2000)
    ap.add_argument("--stop-after", type=float, default=1.0, help="seconds from Enter to Ctrl-C")
    ap.add_argument("--pause", type=float, default=0.6, help="seconds from typing to Enter")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--starting-port", type=int, default=27580)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    from exokv.config import exokv_home

    work = Path(tempfile.mkdtemp(prefix="exokv-two-rank-stop-"))
    runs = []
    started = _load()
    try:
        for n in range(args.rounds):
            for ranks in (1, 2):
                home = work / f"{n}-{ranks}"
                home.mkdir()
                models = exokv_home() / "models"
                if models.is_dir():
                    (home / "models").symlink_to(models)
                runs.append(run_chat(home, args, ranks))
                print(f"  round {n + 1}, {ranks} rank(s): done", file=sys.stderr)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report = {
        "model": args.model,
        "args": vars(args),
        "load_start": started,
        "load_end": _load(),
        "summary": [summary(runs, 1), summary(runs, 2)],
        "runs": runs,
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return
    end = report["load_end"]
    print(f"{args.model}: load (1, 5, 15 min) {started} at the start, {end} at the end")
    for s in report["summary"]:
        print(
            f"{s['ranks']} rank(s): first TTFT median {s['first_ttft_median_s']:.2f} s "
            f"{s['first_ttft_s']}; Ctrl-C -> turn over median {s['ctrl_c_median_s']:.2f} s "
            f"(max {s['ctrl_c_max_s']:.2f}); "
            f"Enter -> bar median {s['enter_to_bar_median_s']:.2f} s "
            f"(max {s['enter_to_bar_max_s']:.2f}, shown {s['bars_shown']})"
        )


if __name__ == "__main__":
    main()
