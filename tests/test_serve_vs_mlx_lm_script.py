"""benchmarks/serve_vs_mlx_lm.py's own failures: bad options and a server that does not
start end the script with one line and an exit code, and leave no process behind."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks import serve_vs_mlx_lm as bench

SCRIPT = Path(bench.__file__)


def run_script(*args: str, home: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "EXOKV_HOME": str(home)},
    )


@pytest.mark.parametrize(
    "args, said",
    [
        (["--ranks", "0"], "--ranks 0: at least 1"),
        (["--ranks", "11"], "--ranks 11: at most 10"),
        (["--starting-port", "80"], "--starting-port 80: use 1024-65506"),
        (["--starting-port", "65510"], "--starting-port 65510: use 1024-65506"),
        (["--conv-turns", "1"], "--conv-turns 1: at least 2"),
        (["--repeats", "0"], "--repeats 0: at least 1"),
        (["--ranks", "two"], "invalid int value: 'two'"),
    ],
)
def test_a_bad_option_is_one_line_and_exit_2(args: list[str], said: str, tmp_path: Path) -> None:
    proc = run_script(*args, home=tmp_path)
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("serve_vs_mlx_lm: ") and said in lines[0]


def test_options_for_two_pipeline_ranks() -> None:
    args = bench.parse_args(["--ranks", "2", "--starting-port", "28590", "--repeats", "5"])
    assert (args.ranks, args.starting_port, args.repeats) == (2, 28590, 5)
    assert bench.parse_args([]).starting_port == 28000


def test_an_unknown_model_is_one_line_and_exit_1(tmp_path: Path) -> None:
    proc = run_script("--model", "builtin:no-such-model", home=tmp_path)
    assert proc.returncode == 1
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("serve_vs_mlx_lm: ") and "no-such-model" in lines[0]


def test_a_server_that_exits_is_named_with_its_last_line() -> None:
    argv = [sys.executable, "-c", "import sys; sys.exit('model not found: x')"]
    with pytest.raises(SystemExit) as ended:
        bench.Server("mlx_lm.server", argv, dict(os.environ), "Starting httpd")
    said = str(ended.value.code)
    assert "\n" not in said
    assert said == "serve_vs_mlx_lm: mlx_lm.server did not start (exit 1): model not found: x"


def test_a_server_never_ready_is_stopped_with_what_it_started(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Ranks a launcher started are in the server's process group: stopped with it."""
    child_pid = tmp_path / "child.pid"
    code = (
        "import subprocess, sys, time; "
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
        f"open({str(child_pid)!r}, 'w').write(str(child.pid)); "
        "print('loading', file=sys.stderr, flush=True); time.sleep(600)"
    )
    monkeypatch.setattr(bench, "START_TIMEOUT_S", 3)
    with pytest.raises(SystemExit) as ended:
        bench.Server("exokv", [sys.executable, "-c", code], dict(os.environ), "serving ")
    assert (
        str(ended.value.code) == "serve_vs_mlx_lm: exokv did not start (not ready in 3 s): loading"
    )
    pid = int(child_pid.read_text())
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pid)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"  # a zombie has ended; its parent (killed too) never reaped it


def test_cache_figures_are_what_the_clients_added_per_rank() -> None:
    run = {
        "cache_before_clients": [{"bytes": 100, "entries": 3}, {"bytes": 90, "entries": 3}],
        "cache_after_clients": [{"bytes": 400, "entries": 9}, {"bytes": 330, "entries": 9}],
    }
    figures = bench.cache_figures(run)
    assert figures["clients_cache_bytes_per_rank"] == [300, 240]
    assert figures["clients_cache_bytes"] == 540
    assert figures["cache_bytes_per_rank"] == [400, 330]
    assert figures["cache_bytes"] == 730


def test_a_rank_that_reported_nothing_gives_no_total(tmp_path: Path) -> None:
    (tmp_path / "rank0.json").write_text('{"bytes": 400, "entries": 9}')
    after = bench.mlx_lm_cache_bytes(tmp_path, 2)
    assert after == [{"bytes": 400, "entries": 9}, {"bytes": -1, "entries": -1}]
    figures = bench.cache_figures({"cache_before_clients": after, "cache_after_clients": after})
    assert figures["cache_bytes"] == -1 and figures["clients_cache_bytes"] == -1
    assert figures["clients_cache_bytes_per_rank"] == [0, -1]


def test_mlx_lm_keeps_a_sequence_for_every_request_of_the_run() -> None:
    args = bench.parse_args(["--repeats", "9", "--clients", "64", "--turns", "4"])
    # warm-up 1 + 9 x (8 streams + 4 conversation turns) + 64 x 4 = 365 requests
    assert bench.mlx_lm_cache_size(args) == 365 + 16


def test_requests_are_counted_by_the_batch_they_were_decoded_in() -> None:
    post = "2026-12-01T08:45:35 127.0.0.1:53328 POST /v1/chat/completions 200 prompt=17"
    log = [
        f"{post} cached=16 completion=5 finish=length ttft=0.006s time=0.112s stream",
        f"{post} cached=0 completion=9 finish=length ttft=0.1s time=0.3s stream batch=7",
        f"{post} cached=0 completion=9 finish=length ttft=0.1s time=0.3s stream batch=7",
        "exokv: serving builtin:base on 1 rank at http://127.0.0.1:8000/v1 (Ctrl-C to stop)",
    ]
    assert bench.requests_by_batch(log) == {1: 1, 7: 2}


class _FakeServer:
    """Records pause/resume instead of signalling a process group."""

    def __init__(self, name: str, pause_when_idle: bool) -> None:
        self.name = name
        self.pause_when_idle = pause_when_idle
        self.paused = False

    def pause(self) -> None:
        self.paused = True

    def resume(self) -> None:
        self.paused = False


def test_a_server_that_spins_while_idle_is_paused_during_the_others_trials(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    exokv, mlx = _FakeServer("exokv", False), _FakeServer("mlx_lm", True)
    seen: list[tuple[str, bool, bool]] = []  # (measured, measured paused, mlx paused)

    def record(server: _FakeServer, *_: object) -> float:
        seen.append((server.name, server.paused, mlx.paused))
        return 1.0

    monkeypatch.setattr(bench, "stream_turn", record)
    monkeypatch.setattr(bench, "throughput", record)
    monkeypatch.setattr(bench, "returning", lambda *a: [record(*a)])
    monkeypatch.setattr(bench, "many_clients", record)
    args = bench.argparse.Namespace(
        repeats=2, streams=8, max_tokens=8, conv_turns=2, clients=2, turns=1
    )
    servers = {"exokv": (exokv, "m"), "mlx_lm": (mlx, "m")}
    bench.measure(servers, args, lambda name: [])  # type: ignore[arg-type]
    assert all(not measured_paused for _, measured_paused, _ in seen)
    assert {mlx_paused for name, _, mlx_paused in seen if name == "exokv"} == {True}
    assert [name for name, _, _ in seen].count("mlx_lm") >= 4
