"""A slow turn as the REPL shows it: Ctrl-C during a long prefill, TTFT, and the bar.

    python benchmarks/prefill_stop.py --model smollm2

For each of 1 and 2 ranks, with typing ahead and with --no-typeahead, the real REPL
(`exokv chat`, in a pseudo-terminal) plays:

1. a short line, typed, a pause of --pause seconds (a draft goes to the ranks and its
   step is in flight), then Enter: the status line's TTFT against Enter to the reply's
   first characters on the terminal, measured here;
2. a bracketed paste of about --paste-tokens tokens, Enter 0.3 s later: the time from
   Enter to the first spinner frame and to the prefill bar on the terminal; Ctrl-C
   --stop-after seconds after Enter: the time from Ctrl-C to "stopped before the reply
   began" on the terminal (the turn has ended on every rank by then);
3. a short line: the chat goes on, and its prompt does not hold the paste (nothing kept).

Enter to first token: as in benchmarks/resume.py, from writing Enter to the arrival
of the reply's first characters. One run; the machine is shared.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from resume import STATUS, Trial
from typeahead import paste_text

FIRST = "Hello there, how are you today?"
AFTER = "Thanks. One more short line."
SPINNER = r"[⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏] prefill"
BAR = r"prefill ━+ [\d,]+/[\d,]+ tokens"
STOPPED = r"stopped before the reply began"


def _seconds(match: re.Match[str]) -> float:
    return float(match.group(4)) / (1000 if match.group(5) == "ms" else 1)


def _until(trial: Trial, pattern: str, mark: int, timeout: float = 600.0) -> float:
    """When `pattern` first arrived on the terminal after byte `mark`."""
    trial.wait_for(pattern, start=mark, timeout=timeout)
    # The chunk that completed the match: the first whose end makes the text match.
    rx = re.compile(pattern)
    for t, end in trial.chunks:
        if end > mark and rx.search(_text(trial, mark, end)):
            return t
    raise AssertionError(pattern)


def _maybe(trial: Trial, pattern: str, mark: int) -> float | None:
    """As `_until` for what may not have shown (a spinner the bar came before)."""
    try:
        return _until(trial, pattern, mark, timeout=0.5)
    except SystemExit:
        return None


def _text(trial: Trial, start: int, end: int) -> str:
    from resume import ANSI

    return ANSI.sub("", trial.raw[start:end].decode("utf-8", "replace"))


def _first_reply_char(trial: Trial, mark: int) -> float:
    """The arrival of the reply's first characters: the first output after the prompt
    is left (bracketed paste turned off) that is neither spinner nor bar."""
    left = trial.raw.index(b"\x1b[?2004l", mark)
    for t, end in trial.chunks:
        if end <= left:
            continue
        shown = _text(trial, left, end)
        cleaned = re.sub(r"[⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏] prefill[^\n]*|prefill ━[^\n]*", "", shown)
        if cleaned.strip():
            return t
    raise AssertionError("no reply")


def run_mode(home: Path, args: argparse.Namespace, ranks: int, typeahead: bool) -> dict[str, Any]:
    extra = ["--ranks", str(ranks), "--starting-port", str(args.starting_port)] if ranks > 1 else []
    if not typeahead:
        extra.append("--no-typeahead")
    trial = Trial(home, args.model, args.max_tokens, *extra)
    trial.wait_for(r"demo › ", timeout=900)
    out: dict[str, Any] = {"ranks": ranks, "typeahead": typeahead}

    # 1. a short line, a pause (its draft step in flight), Enter
    mark = len(trial.raw)
    os.write(trial.fd, FIRST.encode())
    end = time.perf_counter() + args.pause
    while time.perf_counter() < end:
        trial._read(0.01)
    os.write(trial.fd, b"\r")
    enter = time.perf_counter()
    status = trial.wait_for(STATUS.pattern, start=mark)
    outside = _first_reply_char(trial, mark) - enter
    out["short"] = {
        "status_ttft_s": _seconds(status),
        "enter_to_first_token_s": outside,
        "prompt_tokens": int(status.group(1).replace(",", "")),
    }
    trial.wait_for(r"demo › ", start=len(trial.raw) - 200)

    # 2. the paste, Enter, Ctrl-C
    mark = len(trial.raw)
    os.write(trial.fd, b"\x1b[200~" + paste_text(args.paste_tokens).encode() + b"\x1b[201~")
    end = time.perf_counter() + 0.3
    while time.perf_counter() < end:
        trial._read(0.01)
    after_paste = len(trial.raw)
    os.write(trial.fd, b"\r")
    enter = time.perf_counter()
    end = enter + args.stop_after
    while time.perf_counter() < end:
        trial._read(0.01)
    os.write(trial.fd, b"\x03")
    ctrl_c = time.perf_counter()
    stopped = _until(trial, STOPPED, after_paste)
    spinner, bar = _maybe(trial, SPINNER, after_paste), _maybe(trial, BAR, after_paste)
    moving = min(t for t in (spinner, bar, stopped) if t is not None)
    out["stop"] = {
        "ctrl_c_to_turn_end_s": stopped - ctrl_c,
        "enter_to_motion_s": moving - enter,  # the spinner or the bar, whichever came first
        "enter_to_bar_s": None if bar is None else bar - enter,
    }
    trial.wait_for(r"demo › ", start=len(trial.raw) - 200)

    # 3. the chat goes on, without the paste
    mark = len(trial.raw)
    os.write(trial.fd, (AFTER + "\r").encode())
    status = trial.wait_for(STATUS.pattern, start=mark)
    out["after"] = {"prompt_tokens": int(status.group(1).replace(",", ""))}
    trial.quit()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--ranks", default="1,2")
    ap.add_argument("--paste-tokens", type=int, default=2000)
    ap.add_argument("--stop-after", type=float, default=1.0, help="seconds from Enter to Ctrl-C")
    ap.add_argument("--pause", type=float, default=0.6, help="seconds from typing to Enter")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--starting-port", type=int, default=27500)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    from exokv.config import exokv_home

    work = Path(tempfile.mkdtemp(prefix="exokv-prefill-stop-"))
    runs = []
    try:
        for ranks in [int(r) for r in args.ranks.split(",")]:
            for typeahead in (True, False):
                home = work / f"{ranks}-{typeahead}"
                home.mkdir()
                models = exokv_home() / "models"
                if models.is_dir():
                    (home / "models").symlink_to(models)
                runs.append(run_mode(home, args, ranks, typeahead))
                print(f"  {ranks} rank(s), typeahead {typeahead}: done", file=sys.stderr)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps({"model": args.model, "args": vars(args), "runs": runs}, indent=2))
        return
    print(f"{args.model}: paste of ~{args.paste_tokens:,} tokens, Ctrl-C {args.stop_after:g} s "
          "after Enter")  # fmt: skip
    print(f"{'ranks':>5} {'mode':10} {'Ctrl-C->end':>11} {'Enter->moving':>13} {'Enter->bar':>10} "
          f"{'TTFT status':>11} {'TTFT outside':>12} {'after':>6}")  # fmt: skip
    for r in runs:
        s, short = r["stop"], r["short"]
        bar = "-" if s["enter_to_bar_s"] is None else f"{s['enter_to_bar_s']:.2f} s"
        print(
            f"{r['ranks']:>5} {'typeahead' if r['typeahead'] else 'off':10} "
            f"{s['ctrl_c_to_turn_end_s']:>9.2f} s {s['enter_to_motion_s']:>11.2f} s {bar:>10} "
            f"{short['status_ttft_s']:>9.2f} s {short['enter_to_first_token_s']:>10.2f} s "
            f"{r['after']['prompt_tokens']:>6}"
        )


if __name__ == "__main__":
    main()
