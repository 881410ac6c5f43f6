"""Typing ahead: Enter to first token after a paste and after typing, with and without it.

    python benchmarks/typeahead.py --model builtin:base --ranks 1 --paste-tokens 2000
    python benchmarks/typeahead.py --model builtin:base --ranks 2 --paste-tokens 2000

In each run the real REPL (`exokv chat`, in a pseudo-terminal) plays the same script
twice, once with typing ahead and once with `--no-typeahead`, in one process each,
one after the other:

1. a first short turn (it caches the template's start), then a one-line turn typed and
   sent at once: its Enter-to-first-token is the "cached one-line turn";
2. a bracketed paste of about --paste-tokens tokens, Enter --wait seconds later;
3. a --type-chars message typed a character at a time at --cps characters per second,
   then Enter. For every key: the time from writing it to the next output on the
   terminal ("keystroke to screen");
4. the one-line turn again, typed and sent at once: the cached one-line turn at the
   conversation's new length (a long context costs every turn some time).

Enter to first token is the time from writing Enter to the arrival of the reply's first
characters on the terminal (as in benchmarks/resume.py). Replies must be the same with
and without typing ahead (temperature 0; checked).

An idle probe process (benchmarks/stalls.py) runs throughout: keys during which the
machine did not run it either (for at least half the key's time) are counted apart,
and keystroke to screen is also given without them; each mode's stalls are reported.
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

from resume import STATUS, WORDS, Trial
from stalls import StallProbe, stalled, summary

FIRST = "Hello there."
ONE_LINE = "Now one more short line, please."


def paste_text(tokens: int) -> str:
    # builtin:base and builtin:tiny: about 2.9 tokens per word of this text (and its dots).
    words = [WORDS[(i * 7) % len(WORDS)] for i in range(int(tokens / 2.9))]
    lines = [" ".join(words[i : i + 12]) + "." for i in range(0, len(words), 12)]
    return "\n".join(lines)


def typed_text(chars: int) -> str:
    text = ""
    i = 0
    while len(text) < chars:
        text += WORDS[(i * 5) % len(WORDS)] + " "
        i += 1
    return text[:chars].rstrip() + "?"


def _turn(trial: Trial, keys: bytes, mark: int) -> dict[str, Any]:  # mark: where to look
    """Write `keys` (ending with Enter); the status line's numbers and when Enter went."""
    sent = len(trial.raw)  # the prompt leaves after this (bracketed paste turned off)
    os.write(trial.fd, keys)
    enter = time.perf_counter()
    status = trial.wait_for(STATUS.pattern, start=mark)
    trial.wait_for(r"demo › ", start=mark + 1)
    return {
        "enter": enter,
        "sent": sent,
        "prompt_tokens": int(status.group(1).replace(",", "")),
        "cached_tokens": int(status.group(2).replace(",", "")),
        "prefilled_tokens": int(status.group(3).replace(",", "")),
        "engine_ttft_s": float(status.group(4)) / (1000 if status.group(5) == "ms" else 1),
    }


def _type_slowly(trial: Trial, text: str, cps: float) -> list[tuple[float, float]]:
    """Type `text` a key at a time: (when each key went, in time.monotonic(); its time
    to the next output on the terminal)."""
    keys = []
    for ch in text:
        before = len(trial.raw)
        sent = time.perf_counter()
        at = time.monotonic()
        os.write(trial.fd, ch.encode())
        while len(trial.raw) == before and time.perf_counter() - sent < 5.0:
            trial._read(0.002)
        keys.append((at, time.perf_counter() - sent))
        rest = 1.0 / cps - (time.perf_counter() - sent)
        if rest > 0:
            end = time.perf_counter() + rest
            while time.perf_counter() < end:  # keep reading: the terminal never backs up
                trial._read(min(0.01, max(0.0, end - time.perf_counter())))
    return keys


def _percentiles(ms: list[float]) -> dict[str, float]:
    ms = sorted(ms)
    return {
        "p50": statistics.median(ms),
        "p99": ms[min(len(ms) - 1, int(0.99 * len(ms)))],
        "max": ms[-1],
        "keys": len(ms),
    }


def keystrokes(keys: list[tuple[float, float]], gaps: list[tuple[float, float]]) -> dict[str, Any]:
    """Keystroke to screen over all keys, and over the keys the machine ran (the idle
    probe was not stalled for half the key's time or more)."""
    ran = [lat for at, lat in keys if stalled(gaps, at, at + lat) < lat / 2]
    return {
        **_percentiles([lat * 1000 for _, lat in keys]),
        "slowest": sorted(((lat * 1000, i) for i, (_, lat) in enumerate(keys)), reverse=True)[:5],
        "machine_stalled_keys": len(keys) - len(ran),
        "machine_running": _percentiles([lat * 1000 for lat in ran]) if ran else None,
    }


def run_mode(
    home: Path, args: argparse.Namespace, typeahead: bool, probe: StallProbe
) -> dict[str, Any]:
    from exokv.chat.render import visible
    from exokv.state import Store

    extra = ["--ranks", str(args.ranks)] if args.ranks > 1 else []
    if args.ranks > 1:
        extra += ["--starting-port", str(args.starting_port)]
    if not typeahead:
        extra.append("--no-typeahead")
    trial = Trial(home, args.model, args.max_tokens, *extra)
    trial.wait_for(r"demo › ", timeout=900)
    began = time.monotonic()
    turns = {}
    turns["first"] = _turn(trial, (FIRST + "\r").encode(), len(trial.raw))
    turns["one line"] = _turn(trial, (ONE_LINE + "\r").encode(), len(trial.raw))
    mark = len(trial.raw)
    os.write(trial.fd, b"\x1b[200~" + paste_text(args.paste_tokens).encode() + b"\x1b[201~")
    end = time.perf_counter() + args.wait
    while time.perf_counter() < end:
        trial._read(0.01)
    turns["paste"] = _turn(trial, b"\r", mark)
    mark = len(trial.raw)
    keys = _type_slowly(trial, typed_text(args.type_chars), args.cps)
    turns["typed"] = _turn(trial, b"\r", mark)
    # The same one-line turn again, now that the conversation is as long as the last two.
    turns["one line, long"] = _turn(trial, (ONE_LINE + "\r").encode(), len(trial.raw))
    ended = time.monotonic()
    trial.quit()
    with Store.open(home) as store:
        replies = [m["content"] for m in store.load_messages("demo") if m["role"] == "assistant"]
    for turn, reply in zip(turns.values(), replies, strict=True):
        after = trial.raw.index(b"\x1b[?2004l", turn["sent"])
        first = trial.raw.index(visible(reply)[:6].encode(), after)
        turn["enter_to_first_token_s"] = trial.arrival(first) - turn["enter"]
        turn["reply"] = reply
        del turn["enter"], turn["sent"]
    gaps = probe.gaps()
    return {
        "turns": turns,
        "keystroke_ms": keystrokes(keys, gaps),
        "machine_stalls": summary(gaps, began, ended),
        "load_after": os.getloadavg()[0],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="builtin:base")
    ap.add_argument("--ranks", type=int, default=1)
    ap.add_argument("--paste-tokens", type=int, default=2000)
    ap.add_argument("--wait", type=float, default=2.0, help="seconds from the paste to Enter")
    ap.add_argument("--type-chars", type=int, default=300)
    ap.add_argument("--cps", type=float, default=8.0, help="typing speed, characters/s")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--starting-port", type=int, default=27400)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    from exokv.config import exokv_home

    work = Path(tempfile.mkdtemp(prefix="exokv-typeahead-"))
    modes: dict[str, Any] = {}
    probe = StallProbe()
    try:
        for typeahead in (True, False):
            name = "typeahead" if typeahead else "off"
            home = work / name
            home.mkdir()
            models = exokv_home() / "models"
            if models.is_dir():
                (home / "models").symlink_to(models)  # builtins are made once
            modes[name] = run_mode(home, args, typeahead, probe)
            print(f"  {name}: done", file=sys.stderr)
    finally:
        probe.close()
        shutil.rmtree(work, ignore_errors=True)
    on, off = modes["typeahead"], modes["off"]
    for name in on["turns"]:
        if on["turns"][name]["reply"] != off["turns"][name]["reply"]:
            raise SystemExit(f"the {name!r} reply differs with and without typing ahead: a bug")
    doc = {"model": args.model, "ranks": args.ranks, "args": vars(args), "modes": modes}
    if args.json:
        print(json.dumps(doc, indent=2))
        return
    print(
        f"{args.model}, {args.ranks} rank(s): paste of ~{args.paste_tokens:,} tokens, "
        f"Enter {args.wait:g} s later; {args.type_chars} characters typed at {args.cps:g}/s"
    )
    print(f"{'turn':10} {'mode':10} {'Enter->1st token':>17} {'prompt':>7} {'cached':>7} "
          f"{'prefilled':>9}")  # fmt: skip
    for name in on["turns"]:
        for mode, doc_ in modes.items():
            t = doc_["turns"][name]
            print(
                f"{name:10} {mode:10} {t['enter_to_first_token_s']:>15.3f} s "
                f"{t['prompt_tokens']:>7,} {t['cached_tokens']:>7,} {t['prefilled_tokens']:>9,}"
            )
    for short in ("one line", "one line, long"):
        base = on["turns"][short]["enter_to_first_token_s"]
        for name in ("paste", "typed"):
            t = on["turns"][name]["enter_to_first_token_s"]
            print(f"{name}: typing ahead {t / base:.2f}x the {short!r} turn; without it "
                  f"{off['turns'][name]['enter_to_first_token_s'] / base:.2f}x")  # fmt: skip
    for mode, doc_ in modes.items():
        k, m = doc_["keystroke_ms"], doc_["machine_stalls"]
        print(f"keystroke to screen, {mode}: p50 {k['p50']:.1f} ms, p99 {k['p99']:.1f} ms, "
              f"max {k['max']:.1f} ms over {k['keys']} keys")  # fmt: skip
        if k["machine_running"]:
            r, n = k["machine_running"], k["machine_stalled_keys"]
            print(f"  without the {n} keys the machine stalled: p50 {r['p50']:.1f} ms, "
                  f"p99 {r['p99']:.1f} ms, max {r['max']:.1f} ms")  # fmt: skip
        print(f"  machine stalls (an idle process not run): {m['stalls_over_0.1s']} over 0.1 s, "
              f"{m['stalls_over_1s']} over 1 s, longest {m['longest_s']:.2f} s, "
              f"{m['lost_s']:.1f} s of {m['seconds']:.0f} s lost")  # fmt: skip


if __name__ == "__main__":
    main()
