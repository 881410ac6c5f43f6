"""benchmarks/pipeline_prefill.py runs on two real ranks and reports every piece size;
a bad model or --ranks is one line and an exit code."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from chat_helpers import home_with_models

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "pipeline_prefill.py"


def run_script(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=150,
        env={**os.environ, "EXOKV_HOME": str(home)},
    )


@pytest.mark.slow
@pytest.mark.timeout(170)
def test_two_ranks_report_each_piece_size_beside_one_rank(tmp_path: Path, models_dir: Path) -> None:
    home = home_with_models(tmp_path / "home", models_dir, link=True)
    args = ["--model", "builtin:tiny", "--tokens", "160", "--repeats", "2", "--pieces", "512,32"]
    proc = run_script(home, *args, "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    medians = doc["median_tokens_per_s"]
    assert list(medians) == ["1 rank", "2 ranks, 512-token pieces", "2 ranks, 32-token pieces"]
    assert all(v > 0 for v in medians.values())
    assert all(len(trials) == 2 for trials in doc["tokens_per_s"].values())


@pytest.mark.parametrize(
    "args, said",
    [
        (["--ranks", "1"], "pipeline_prefill: --ranks must be 2 or more"),
        (["--model", "builtin:no-such-model"], "pipeline_prefill: "),
    ],
)
def test_bad_input_is_one_line_and_exit_1(args: list[str], said: str, tmp_path: Path) -> None:
    proc = run_script(tmp_path, *args)
    assert proc.returncode == 1
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(said)
