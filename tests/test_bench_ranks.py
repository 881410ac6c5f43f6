"""`exokv bench --ranks 2`: the same document as one rank, from ranks started by mlx.launch.

Each multi-rank run has its own --starting-port (4630x) so tests never share a ring.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from chat_helpers import home_with_models

from exokv.bench import STRATEGIES

pytestmark = pytest.mark.slow  # starts ranks, servers or real models: see tests/conftest.py

ARGS = ["--model", "builtin:tiny", "--turns", "2", "--context", "150", "--scenario", "linear"]


def _env(home: Path) -> dict[str, str]:
    env = {**os.environ, "EXOKV_HOME": str(home)}
    env.pop("EXOKV_DEBUG", None)
    return env


def _bench(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "exokv", "bench", *ARGS, "--json", *args],
        capture_output=True,
        text=True,
        timeout=240,
        env=_env(home),
    )


def _start_bench(home: Path, port: int, **streams: Any) -> subprocess.Popen:
    """`exokv bench --json` on two ranks, started and left running: four turns of a
    longer context, so there is time to find (and kill) its processes."""
    return subprocess.Popen(
        [sys.executable, "-m", "exokv", "bench", *ARGS, "--json", "--turns", "4"]
        + ["--context", "600", "--ranks", "2", "--starting-port", str(port)],
        env=_env(home),
        **streams,
    )


@pytest.fixture(scope="module")
def docs(tmp_path_factory: pytest.TempPathFactory, models_dir: Path) -> tuple[dict, dict]:
    root = tmp_path_factory.mktemp("bench-ranks")
    one = _bench(home_with_models(root / "one", models_dir))
    assert one.returncode == 0, one.stderr
    two = _bench(
        home_with_models(root / "two", models_dir),
        *("--ranks", "2", "--parallel", "pipeline", "--starting-port", "26300"),
    )
    assert two.returncode == 0, two.stderr
    return json.loads(one.stdout), json.loads(two.stdout)


def _fields(node: object, path: str = "") -> set[str]:
    out: set[str] = set()
    if isinstance(node, dict):
        for key, value in node.items():
            out.add(f"{path}/{key}")
            out |= _fields(value, f"{path}/{key}")
    elif isinstance(node, list):
        for item in node:
            out |= _fields(item, f"{path}[]")
    return out


@pytest.mark.timeout(300)
def test_two_ranks_give_the_one_rank_document(docs: tuple[dict, dict]) -> None:
    one, two = docs
    assert _fields(two) == _fields(one)
    assert (one["ranks"], two["ranks"]) == (1, 2)
    assert two["parallel"] == "pipeline"
    assert two["replies_match"], two["mismatches"]
    assert two["command"].startswith("exokv bench ") and "--ranks 2" in two["command"]
    turns_one = one["scenarios"]["linear"]["turns"]
    turns_two = two["scenarios"]["linear"]["turns"]
    assert len(turns_two) == len(turns_one) == 2
    for a, b in zip(turns_one, turns_two, strict=True):
        for s in STRATEGIES:
            x, y = a["strategies"][s], b["strategies"][s]
            keys = ("prompt_tokens", "cached_tokens", "prefilled_tokens", "generated_tokens")
            assert {k: y[k] for k in keys} == {k: x[k] for k in keys}, (s, a["turn"])
            assert y["reply"] == x["reply"]  # the sharded model gives the same greedy replies
    assert turns_two[1]["strategies"]["exokv"]["cached_tokens"] > 0
    # One value per rank; pipeline ranks each hold half of builtin:tiny's layers.
    summary_one, summary_two = one["scenarios"]["linear"], two["scenarios"]["linear"]
    for s in STRATEGIES:
        peaks = summary_two["strategies"][s]["peak_cache_bytes"]
        assert len(peaks) == 2
        assert sum(peaks) == summary_one["strategies"][s]["peak_cache_bytes"][0]
    for key in ("bytes_per_token", "bytes_per_token_unquantized", "bytes_per_token_fp16"):
        assert len(summary_two[key]) == 2, key
        assert sum(summary_two[key]) == summary_one[key][0], key


@pytest.mark.timeout(300)
def test_tensor_parallel_replies_match(tmp_path: Path, models_dir: Path) -> None:
    # Also guards the bench's synchronisation: a step generate_step left queued on its
    # own stream used to race the next prefill's all_sums and garble carried/mlx-lm-lru.
    proc = _bench(
        home_with_models(tmp_path / "h", models_dir),
        *("--ranks", "2", "--parallel", "tensor", "--starting-port", "26310"),
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["replies_match"], doc["mismatches"]
    assert doc["scenarios"]["linear"]["turns"][1]["strategies"]["exokv"]["cached_tokens"] > 0


def _processes_of(home: Path) -> list[int]:
    """Processes started with this EXOKV_HOME (the bench, its launcher, its ranks)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"EXOKV_HOME={home}".encode() in environ:
            found.append(int(entry.name))
    return found


def _rank_pid(home: Path, rank: int) -> int | None:
    for pid in _processes_of(home):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"exokv.bench.rank_main" in cmd and f"MLX_RANK={rank}".encode() in environ:
            return pid
    return None


@pytest.mark.timeout(120)
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the ranks through /proc")
def test_a_rank_that_dies_ends_the_bench_in_one_line(tmp_path: Path, models_dir: Path) -> None:
    home = home_with_models(tmp_path / "h", models_dir)
    proc = _start_bench(home, 26320, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        pid = None
        while pid is None and time.monotonic() < deadline and proc.poll() is None:
            pid = _rank_pid(home, 1)
            time.sleep(0.2)
        assert pid is not None, "rank 1 never started"
        time.sleep(2.0)  # loading or running: either way the bench must end cleanly
        os.kill(pid, 9)
        killed = time.monotonic()
        out, err = proc.communicate(timeout=30)
        assert time.monotonic() - killed < 15
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1
    lines = [x for x in err.strip().splitlines() if x.strip()]
    assert len(lines) == 1 and "rank 1" in lines[0], err
    assert out == ""
    time.sleep(0.5)
    assert _processes_of(home) == []


@pytest.mark.timeout(120)
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the ranks through /proc")
def test_killing_the_front_end_leaves_no_ranks(tmp_path: Path, models_dir: Path) -> None:
    # The launcher has its own process group (Ctrl-C reaches the front end only), so
    # a SIGKILL to the front end (a script's timeout) must not leave it running.
    home = home_with_models(tmp_path / "h", models_dir)
    proc = _start_bench(home, 26330, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while _rank_pid(home, 1) is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _rank_pid(home, 1) is not None, "rank 1 never started"
    proc.kill()
    proc.wait(timeout=10)
    deadline = time.monotonic() + 15
    while _processes_of(home) and time.monotonic() < deadline:
        time.sleep(0.25)
    assert _processes_of(home) == []
