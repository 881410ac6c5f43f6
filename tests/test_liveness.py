"""A rank's liveness from its heartbeat and its host's watcher (issue 28 item 4).

The rule (exokv.launch.supervise): a late heartbeat with a host that says the rank
runs is busy, until the wedged limit; stopped, gone, or no word from the host is
dead within the heartbeat timeout. Here the rule on lines fed to the Supervisor
as the launcher relays them, the fast path for ranks on this machine, and the
watcher process itself. The chats over ssh are in tests/test_liveness_remote.py.
"""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from exokv.hosts.hostfile import Host
from exokv.launch.command import LaunchPlan
from exokv.launch.supervise import Supervisor
from exokv.launch.watcher import state_line

TIMEOUT = 10.0


def _plan(local: bool) -> LaunchPlan:
    names = ["127.0.0.1", "127.0.0.1"] if local else ["mac-a", "mac-b"]
    hosts = [Host(n, ["127.0.0.1"]) for n in names]
    return LaunchPlan([], 2, hosts, "ring", local, "127.0.0.1", 1)


def _supervisor(
    local: bool = False, lines: tuple[str, ...] = (), wedged: float = 600
) -> Supervisor:
    ranks = Supervisor(_plan(local), TIMEOUT, wedged_after=wedged)
    ranks.expect_beats()
    # As the launcher relays them: the drain is the only reader of a watcher's word.
    ranks._drain("stderr", io.BytesIO("".join(lines).encode()))
    return ranks


def test_a_watcher_line_glued_to_a_rank_error_is_read_and_the_error_kept() -> None:
    error = 'exokv-rank-error {"rank": 1, "message": "missing file"}'
    ranks = _supervisor(lines=(error + state_line(0, "running", 4242),))
    assert ranks.states[0][0] == "running"
    assert [line.startswith(error) for line in ranks.tails["stderr"]] == [True]


def _late(ranks: Supervisor, rank: int, seconds: float) -> str | None:
    ranks.beats[rank] = time.monotonic() - seconds
    ranks._checked = time.monotonic()
    return ranks.silent()


def test_a_late_beat_with_a_running_process_is_busy_and_the_rest_is_dead() -> None:
    line = state_line(1, "running", 4242)
    assert _late(_supervisor(lines=(line,)), 1, 30) is None  # busy
    # The watcher's line is not kept as the ranks' output.
    assert list(_supervisor(lines=(line,)).tails["stderr"]) == []
    cause = _late(_supervisor(), 1, 30)  # nothing from the host either
    assert cause is not None and cause.startswith("rank 1 stopped responding"), cause
    assert "no word from its host 'mac-b'" in cause
    cause = _late(_supervisor(lines=(state_line(1, "stopped", 4242),)), 1, 30)
    assert cause == (
        "rank 1 stopped responding (no heartbeat for 10 s; its process on 'mac-b' is stopped)"
    )
    cause = _late(_supervisor(lines=(state_line(1, "gone", 4242),)), 1, 30)
    assert cause is not None and "its process on 'mac-b' has gone" in cause
    # Within the timeout a beat is enough, whatever the host said.
    assert _late(_supervisor(lines=(state_line(1, "stopped", 4242),)), 1, 5) is None


def test_the_hosts_word_counts_only_while_it_is_fresh() -> None:
    ranks = _supervisor(lines=(state_line(1, "running", 4242),))
    state, _, pid = ranks.states[1]
    ranks.states[1] = (state, time.monotonic() - TIMEOUT - 1, pid)  # the host went quiet too
    cause = _late(ranks, 1, 30)
    assert cause is not None and "no word from its host" in cause


def test_a_running_rank_silent_past_the_limit_is_reported_wedged_by_rank_and_host() -> None:
    ranks = _supervisor(lines=(state_line(1, "running", 4242),), wedged=60)
    assert _late(ranks, 1, 59) is None
    assert _late(ranks, 1, 61) == (
        "rank 1 on 'mac-b' is wedged: its process runs but has said nothing for over 60 s"
    )


def test_rank_0s_channel_is_judged_by_the_same_rule() -> None:
    ranks = _supervisor(lines=(state_line(0, "running", 4242),))
    ranks._checked = time.monotonic()
    assert ranks.silent(channel_seen=time.monotonic() - 30) is None
    ranks = _supervisor(lines=(state_line(0, "stopped", 4242),))
    ranks._checked = time.monotonic()
    cause = ranks.silent(channel_seen=time.monotonic() - 30)
    assert cause is not None and cause.startswith("rank 0 stopped responding"), cause


@pytest.fixture
def sleeper() -> Iterator[psutil.Process]:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        yield psutil.Process(proc.pid)
    finally:
        proc.kill()
        proc.wait()


def _stopped(process: psutil.Process) -> None:
    process.suspend()
    deadline = time.monotonic() + 10
    while process.status() != psutil.STATUS_STOPPED:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_a_rank_on_this_machine_is_asked_of_the_os_and_a_remote_one_never(
    sleeper: psutil.Process,
) -> None:
    """The pid a watcher named: here the OS says at once that it stopped (the watcher's
    next line may be late in the launcher's pipes); a remote host's pid means nothing
    here, so only its watcher's lines count."""
    line = state_line(1, "running", sleeper.pid)
    local, remote = _supervisor(True, (line,)), _supervisor(False, (line,))
    assert _late(local, 1, 30) is None and _late(remote, 1, 30) is None
    _stopped(sleeper)
    cause = _late(local, 1, 30)
    assert cause is not None and "its process on '127.0.0.1' is stopped" in cause
    assert _late(remote, 1, 30) is None  # its host still says running
    sleeper.kill()
    sleeper.wait(10)
    cause = _late(local, 1, 30)
    assert cause is not None and "has gone" in cause


# -- the watcher process -------------------------------------------------------------

# A stand-in rank: starts its watcher as a rank does, then reads stdin as rank 0 reads
# its bootstrap line, says what it got, and waits.
# `front_end`: its pid as a local rank's --front-end-pid (its beat thread is not run).
RANK = """
import os, sys, time
from exokv.rank import boot
watcher = boot.watch(1, int(sys.argv[1]) if len(sys.argv) > 1 else None)
print(watcher.pid, sys.stdin.readline().strip(), flush=True)
time.sleep(60)
"""


class StandIn:
    def __init__(self, front_end: int | None = None, env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", RANK, *([str(front_end)] if front_end else [])],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={**os.environ, "MLX_RANK": "1", **(env or {})},
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(b'{"token": "t"}\n')
        self.proc.stdin.flush()
        pid, self.got = self.proc.stdout.readline().decode().strip().split(" ", 1)
        self.watcher = psutil.Process(int(pid))
        self.rank = psutil.Process(self.proc.pid)

    def states(self, count: int) -> list[str]:
        """The states in the next `count` lines of the watcher (fewer once it has ended)."""
        assert self.proc.stderr is not None
        lines = [self.proc.stderr.readline().decode().split() for _ in range(count)]
        lines = [x for x in lines if x]
        assert all(x[:2] == ["exokv-state", "1"] and x[3] == str(self.rank.pid) for x in lines)
        return [x[2] for x in lines]

    def close(self) -> None:
        for p in (self.rank, self.watcher):
            try:
                p.kill()
            except psutil.Error:
                pass
        self.proc.wait(10)


@pytest.mark.timeout(60)
def test_the_watcher_says_running_stopped_gone_and_changes_nothing_the_rank_sees() -> None:
    rank = StandIn()
    try:
        assert rank.got == '{"token": "t"}'  # stdin is the rank's alone
        assert rank.rank.environ()["MLX_RANK"] == "1"
        assert "MLX_RANK" not in rank.watcher.environ()  # only the rank is a rank
        assert rank.watcher.ppid() == rank.rank.pid
        assert rank.states(2) == ["running", "running"]
        _stopped(rank.rank)
        states = rank.states(3)
        assert states[-1] == "stopped", states  # one line may have been said before
        rank.rank.kill()
        rank.proc.wait(10)
        assert rank.states(3)[-1] == "gone"
        rank.watcher.wait(10)  # and it ends with the rank (psutil.TimeoutExpired else)
    finally:
        rank.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["hangup", "reader-gone"])
def test_a_watcher_whose_session_ends_ends_its_rank_even_a_stopped_one(how: str) -> None:
    """ssh hanging up (SIGHUP) or nobody left to read its lines: the session is over;
    a stopped rank would never end by itself, and none may outlive a chat."""
    rank = StandIn()
    try:
        assert rank.states(1) == ["running"]
        _stopped(rank.rank)
        if how == "hangup":
            rank.watcher.send_signal(signal.SIGHUP)
        else:
            assert rank.proc.stderr is not None
            rank.proc.stderr.close()
        assert rank.proc.wait(15) == -signal.SIGTERM  # told to end, and it could
        rank.watcher.wait(10)
    finally:
        rank.close()


@pytest.mark.timeout(60)
def test_a_watcher_ends_its_rank_when_the_front_end_is_gone(tmp_path: Path) -> None:
    """A rank whose own beat thread cannot run (a call holding its GIL, as the ring's
    connect does at start-up) still ends with its front end: its watcher ends it, and
    removes the launcher's folder the front end would have."""
    front_end = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    scratch = tmp_path / "exokv-ranks-1-x"
    scratch.mkdir()
    rank = StandIn(front_end.pid, env={"TMPDIR": str(scratch)})
    try:
        assert rank.states(2) == ["running", "running"]  # a live front end ends nothing
        front_end.kill()
        front_end.wait(10)
        assert rank.proc.wait(15) == -signal.SIGTERM
        rank.watcher.wait(10)
        assert not scratch.exists()
    finally:
        front_end.kill()
        rank.close()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_wedged_limit_that_is_no_number_is_one_line(tmp_path, models_dir) -> None:
    from chat_helpers import home_with_models, run_exokv

    home = home_with_models(tmp_path / "h", models_dir, link=True)
    proc = run_exokv(
        ["chat", "-m", "builtin:tiny", "-n", "2", "--starting-port", "28730"],
        home,
        "hi\n",
        env={"EXOKV_TEST_WEDGED_S": "soon"},
    )
    err = proc.stderr.decode().strip().splitlines()
    assert proc.returncode != 0 and err == [
        "exokv: error: EXOKV_TEST_WEDGED_S='soon' is not a number of seconds"
    ], err
