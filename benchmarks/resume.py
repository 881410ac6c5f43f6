"""Enter-to-first-token on the first turn after resuming a chat: KV on disk vs none.

    python benchmarks/resume.py --model builtin:base --history 2000 --repeats 3

1. A chat of a few long turns is run once in script mode (`--session demo`) until
   its history is at least --history tokens; quitting keeps its KV cache in the
   disk tier.
2. Each trial copies that EXOKV_HOME, starts `exokv chat --session demo` in a
   pseudo-terminal (the real REPL), waits for the prompt, types one short line and
   presses Enter. The time from writing Enter to the arrival of the reply's first
   character on the terminal is "Enter to first token". "saved" trials resume with
   the disk tier (the first turn loads the history's KV from disk); "cold" trials
   have the disk tier deleted first, so the whole history is prefilled. Trials
   alternate so machine noise hits both alike.
Also reported: the engine's own TTFT (status line), tokens cached/prefilled, the
time from start to the prompt (it includes restoring the tier's tree), and the
tokens the banner says are on disk.
The reply must be the same in both modes (checked).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import pty
import re
import select
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import termios
import time
from pathlib import Path
from typing import Any

WORDS = (
    "river stone light window garden paper music winter orange signal harbor "
    "forest bridge candle thunder silver meadow lantern compass feather"
).split()
QUESTION = "Now tell me, in one line, what all of that was about."
ANSI = re.compile(
    r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[()][0-9A-Za-z]|\x1b[=>78]|\r"
)
STATUS = re.compile(
    r"([\d,]+) prompt · ([\d,]+) cached \(\d+%\) · ([\d,]+) prefilled[^\n]*TTFT ([\d.]+) (ms|s)"
)


def user_text(turn: int, words: int) -> str:
    return " ".join(WORDS[(turn * 7 + i * 3) % len(WORDS)] for i in range(words))


def exokv(*args: str) -> list[str]:
    return [sys.executable, "-m", "exokv", *args]


def build_history(home: Path, model: str, target: int, reply_tokens: int) -> dict[str, Any]:
    """Script-mode turns until the conversation holds `target` tokens; returns the last turn."""
    last = None
    env = {**os.environ, "EXOKV_HOME": str(home)}
    turn = 0
    while last is None or last["prompt_tokens"] + last["generated_tokens"] < target:
        turn += 1
        lines = [user_text(turn, 180)]  # one turn per process: each resumes the last
        proc = subprocess.run(
            exokv("chat", "--model", model, "--json", "--session", "demo")
            + ["--max-tokens", str(reply_tokens)],
            input=("\n".join(lines) + "\n").encode(),
            capture_output=True,
            env=env,
            check=False,
        )
        if proc.returncode != 0:
            raise SystemExit(proc.stderr.decode())
        last = json.loads(proc.stdout.decode().splitlines()[-1])
        total = last["prompt_tokens"] + last["generated_tokens"]
        print(f"  history: turn {turn}, {total:,} tokens", file=sys.stderr)
    return last


def _take_terminal() -> None:
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


class Trial:
    """One REPL in a pseudo-terminal, with the arrival time of every chunk it writes."""

    def __init__(self, home: Path, model: str, max_tokens: int, *extra: str) -> None:
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 200, 0, 0))
        env = {k: v for k, v in os.environ.items() if k != "NO_COLOR"}
        env.update(EXOKV_HOME=str(home), TERM="xterm-256color", PROMPT_TOOLKIT_NO_CPR="1")
        self.started = time.perf_counter()
        self.proc = subprocess.Popen(
            exokv("chat", "--model", model, "--session", "demo", "--max-tokens", str(max_tokens))
            + list(extra),
            stdin=slave,
            stdout=slave,
            stderr=slave,
            env=env,
            start_new_session=True,
            preexec_fn=_take_terminal,
            close_fds=True,
        )
        os.close(slave)
        self.fd = master
        self.raw = b""
        self.chunks: list[tuple[float, int]] = []  # (arrival, offset of the chunk's end)

    def _read(self, timeout: float) -> None:
        if select.select([self.fd], [], [], timeout)[0]:
            try:
                data = os.read(self.fd, 65536)
            except OSError:
                data = b""
            if data:
                self.raw += data
                self.chunks.append((time.perf_counter(), len(self.raw)))

    def wait_for(self, pattern: str, start: int = 0, timeout: float = 600.0) -> re.Match[str]:
        rx = re.compile(pattern)
        end = time.perf_counter() + timeout
        while time.perf_counter() < end:
            text = ANSI.sub("", self.raw[start:].decode("utf-8", "replace"))
            found = rx.search(text)
            if found:
                return found
            if self.proc.poll() is not None and not select.select([self.fd], [], [], 0)[0]:
                break  # the chat is gone: say what it showed rather than wait on
            self._read(0.01)
        raise SystemExit(f"no {pattern!r} on the terminal:\n{self.text()[-2000:]}")

    def arrival(self, offset: int) -> float:
        for t, end in self.chunks:
            if end > offset:
                return t
        raise ValueError(offset)

    def text(self) -> str:
        return ANSI.sub("", self.raw.decode("utf-8", "replace"))

    def quit(self) -> None:
        os.write(self.fd, b"\x04")
        end = time.perf_counter() + 60
        while self.proc.poll() is None and time.perf_counter() < end:
            self._read(0.05)
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        os.close(self.fd)


def run_trial(base: Path, work: Path, model: str, saved: bool) -> dict[str, Any]:
    from exokv.chat.render import visible
    from exokv.state import Store

    home = work / ("saved" if saved else "cold")
    shutil.rmtree(home, ignore_errors=True)
    shutil.copytree(base, home, symlinks=True)
    if not saved:
        shutil.rmtree(home / "kv")
    trial = Trial(home, model, max_tokens=8)
    ready = trial.wait_for(r"demo › ")
    at_prompt = time.perf_counter() - trial.started
    loaded = re.search(r"its KV cache: ([\d,]+) tokens on disk", trial.text())
    mark = len(trial.raw)
    os.write(trial.fd, (QUESTION + "\r").encode())
    enter = time.perf_counter()
    status = trial.wait_for(STATUS.pattern, start=mark)
    trial.wait_for(r"demo › ", start=mark + 1)
    trial.quit()
    del ready
    with Store.open(home) as store:
        reply = store.load_messages("demo")[-1]["content"]
    # The reply's first characters after the prompt leaves (bracketed paste turned off).
    after = trial.raw.index(b"\x1b[?2004l", mark)
    first = trial.raw.index(visible(reply)[:6].encode(), after)
    ttft = float(status.group(4)) / (1000 if status.group(5) == "ms" else 1)
    return {
        "mode": "saved" if saved else "cold",
        "enter_to_first_token_s": trial.arrival(first) - enter,
        "engine_ttft_s": ttft,
        "prompt_tokens": int(status.group(1).replace(",", "")),
        "cached_tokens": int(status.group(2).replace(",", "")),
        "prefilled_tokens": int(status.group(3).replace(",", "")),
        "start_to_prompt_s": at_prompt,
        "on_disk_tokens": int(loaded.group(1).replace(",", "")) if loaded else 0,
        "reply": reply,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="builtin:base")
    ap.add_argument("--history", type=int, default=2000, help="tokens of history at least")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--reply-tokens", type=int, default=32)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="exokv-resume-"))
    try:
        base = work / "base"
        base.mkdir()
        last = build_history(base, args.model, args.history, args.reply_tokens)
        history = last["prompt_tokens"] + last["generated_tokens"]
        trials = []
        for _ in range(args.repeats):
            for saved in (True, False):
                trials.append(run_trial(base, work, args.model, saved))
                print(
                    f"  {trials[-1]['mode']:5}  enter->first token "
                    f"{trials[-1]['enter_to_first_token_s']:.3f} s",
                    file=sys.stderr,
                )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if len({t["reply"] for t in trials}) != 1:
        raise SystemExit("the reply after resume differs between saved and cold: a bug")
    summary = {}
    for mode in ("saved", "cold"):
        rows = [t for t in trials if t["mode"] == mode]
        summary[mode] = {
            key: statistics.median(r[key] for r in rows)
            for key in (
                "enter_to_first_token_s",
                "engine_ttft_s",
                "start_to_prompt_s",
                "prompt_tokens",
                "cached_tokens",
                "prefilled_tokens",
                "on_disk_tokens",
            )
        }
    speedup = summary["cold"]["enter_to_first_token_s"] / summary["saved"]["enter_to_first_token_s"]
    doc = {
        "model": args.model,
        "history_tokens": history,
        "repeats": args.repeats,
        "summary": summary,
        "speedup": speedup,
        "trials": trials,
    }
    if args.json:
        print(json.dumps(doc, indent=2))
        return
    print(f"{args.model}, history {history:,} tokens, median of {args.repeats} trials each")
    print(
        f"{'resume':8} {'Enter->1st token':>17} {'engine TTFT':>12} {'cached':>7} "
        f"{'prefilled':>9} {'start->prompt':>14} {'on disk':>8}"
    )
    for mode, s in summary.items():
        print(
            f"{mode:8} {s['enter_to_first_token_s']:>15.3f} s {s['engine_ttft_s']:>10.3f} s "
            f"{s['cached_tokens']:>7,} {s['prefilled_tokens']:>9,} "
            f"{s['start_to_prompt_s']:>12.2f} s {s['on_disk_tokens']:>8,}"
        )
    print(f"speedup of Enter->first token with the KV on disk: {speedup:.1f}x")


if __name__ == "__main__":
    main()
