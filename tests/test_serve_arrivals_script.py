"""benchmarks/serve_arrivals.py's bad options: one line and exit 2, no server started."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "serve_arrivals.py"


@pytest.mark.parametrize(
    "args, said",
    [
        (["--staggered", "0"], "--staggered 0: at least 1"),
        (["--ranks", "0"], "--ranks 0: at least 1"),
        (["--heavy", "two"], "invalid int value: 'two'"),
        (["--newcomer-after-s", "-1"], "--newcomer-after-s -1.0: not negative"),
        (["--only", "sideways"], "invalid choice: 'sideways'"),
        (["--staggered", "16,0"], "--staggered 0: at least 1"),
        (["--staggered-gap-ms", "50,-1"], "--staggered-gap-ms -1.0: not negative"),
    ],
)
def test_bad_options_are_one_line(tmp_path: Path, args: list[str], said: str) -> None:
    run = subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "EXOKV_HOME": str(tmp_path)},
    )
    assert run.returncode == 2
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and said in lines[0], run.stderr
