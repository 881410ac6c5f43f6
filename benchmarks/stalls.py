"""The machine's own stalls, seen by a process that does nothing but sleep.

On a shared or virtual machine every process can go unscheduled for a while at once
(here, a Firecracker VM with two vCPUs: 0.2 to 6 s several times a minute under load,
seen alike by a C program calling usleep(5 ms), the benchmark driver, the chat and
every rank). A keystroke or a turn timed across such a stall measures the machine,
not exokv. `StallProbe` runs a separate, idle Python process that sleeps 5 ms at a
time and writes down every wake-up later than `--min-gap`; `stalled` says how much of
a time window it overlapped, so a benchmark can report its figures with and without
the windows the machine itself was not running.

    python benchmarks/stalls.py --seconds 60     # the machine alone, for a minute
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# The probe: CLOCK_MONOTONIC is the whole machine's, so its times compare with
# time.monotonic() in the benchmark.
_PROBE = """
import sys, time
out = open(sys.argv[1], "w", buffering=1)
least = float(sys.argv[2])
last = time.monotonic()
while True:
    time.sleep(0.005)
    now = time.monotonic()
    if now - last > least:
        out.write(f"{last!r} {now!r}\\n")
    last = now
"""


class StallProbe:
    def __init__(self, min_gap: float = 0.05) -> None:
        self._file = Path(tempfile.mkstemp(prefix="exokv-stalls-", suffix=".txt")[1])
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _PROBE, str(self._file), str(min_gap)],
            stdin=subprocess.DEVNULL,
        )
        self.started = time.monotonic()

    def gaps(self) -> list[tuple[float, float]]:
        """(start, end) of every stall so far, in time.monotonic()."""
        out = []
        for line in self._file.read_text().splitlines():
            parts = line.split()
            if len(parts) == 2:
                out.append((float(parts[0]), float(parts[1])))
        return out

    def close(self) -> list[tuple[float, float]]:
        gaps = self.gaps()
        self._proc.kill()
        self._proc.wait()
        self._file.unlink(missing_ok=True)
        return gaps


def stalled(gaps: list[tuple[float, float]], start: float, end: float) -> float:
    """Seconds of [start, end] during which the probe was not run."""
    return sum(max(0.0, min(end, b) - max(start, a)) for a, b in gaps)


def summary(gaps: list[tuple[float, float]], start: float, end: float) -> dict[str, Any]:
    """The probe's stalls within [start, end]: how many, the longest, the time lost."""
    inside = [b - a for a, b in gaps if b > start and a < end]
    return {
        "seconds": end - start,
        "stalls_over_0.1s": sum(g > 0.1 for g in inside),
        "stalls_over_1s": sum(g > 1.0 for g in inside),
        "longest_s": max(inside, default=0.0),
        "lost_s": stalled(gaps, start, end),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--min-gap", type=float, default=0.05)
    args = ap.parse_args()
    probe = StallProbe(args.min_gap)
    start = time.monotonic()
    time.sleep(args.seconds)
    end = time.monotonic()
    gaps = probe.close()
    print(summary(gaps, start, end))
    for a, b in gaps:
        print(f"  +{a - start:7.2f} s: not run for {b - a:.3f} s")


if __name__ == "__main__":
    main()
