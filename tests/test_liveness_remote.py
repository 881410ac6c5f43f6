"""A busy remote rank is never dead; a stopped one is; a wedged one is reported.

Chats over real ssh on the two hosts of tests/ssh_hosts.py (rank 1 on `exokv-b`):
the hosts are not "this machine" to the front end, so what it knows of rank 1's
process comes from rank 1's watcher's lines alone (exokv.launch.watcher), relayed by
ssh and mlx.launch like the rank's own output.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
from chat_helpers import end_input, home_with_models
from ssh_hosts import SshHosts
from test_multihost import SCRIPT, _hostfile, _ranks_left

pytestmark = pytest.mark.slow  # starts ranks, servers or real models: see tests/conftest.py

HOLD_S = 30
IDLE_BOUND = 0.1  # of one core: the launcher spinning on the ranks' stdin used 1.3


class RemoteChat:
    """`exokv chat --json` over the two hosts, its stderr read as it comes."""

    def __init__(self, home: Path, ssh_hosts: SshHosts, port: int, *args: str, **env: str):
        hostfile = _hostfile(home.parent / f"hosts-{port}.json", home, True)
        full_env = ssh_hosts.env(EXOKV_HOME=str(home), **env)
        if "EXOKV_DEBUG" not in env:
            full_env.pop("EXOKV_DEBUG", None)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "exokv", "chat", "-m", "builtin:tiny", "--json"]
            + ["--max-tokens", "8", "--hostfile", str(hostfile), "--starting-port", str(port)]
            + list(args),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=full_env,
        )
        self.err: list[tuple[float, str]] = []
        threading.Thread(target=self._read_stderr, daemon=True).start()

    def _read_stderr(self) -> None:
        assert self.proc.stderr is not None
        for raw in iter(self.proc.stderr.readline, b""):
            self.err.append((time.monotonic(), raw.decode(errors="replace").rstrip()))

    def send(self, line: str) -> dict[str, Any]:
        import json

        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write((line + "\n").encode())
        self.proc.stdin.flush()
        out = self.proc.stdout.readline()
        assert out, self.said()
        return json.loads(out)

    def when(self, text: str, timeout: float) -> float:
        """When a line of stderr holding `text` came (waiting up to `timeout` for it)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for at, line in list(self.err):
                if text in line:
                    return at
            time.sleep(0.2)
        raise AssertionError(f"no {text!r} in stderr:\n{self.said()}")

    def said(self) -> str:
        return "\n".join(line for _, line in self.err)

    def lines(self) -> list[str]:
        """What the user sees on stderr (not the ranks' own lines shown by EXOKV_DEBUG)."""
        return [line for _, line in self.err if not line.startswith("[ranks ")]

    def finish(self, timeout: float = 60) -> int:
        try:
            return end_input(self.proc, timeout)
        finally:
            time.sleep(0.5)  # the last lines reach self.err


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, models_dir: Path) -> list[str]:
    """The replies of an undisturbed chat (one rank: replies equal across layouts)."""
    from test_cluster import replies, run_script

    home = home_with_models(tmp_path_factory.mktemp("ref"), models_dir)
    return replies(run_script(home, SCRIPT))


def _rank_process(home: Path, rank: int) -> psutil.Process:
    found = [
        p
        for p in psutil.process_iter(["pid", "cmdline"])
        if "exokv.rank.main" in " ".join(p.info["cmdline"] or [])
        and p.environ().get("EXOKV_HOME") == str(home)
        and p.environ().get("MLX_RANK") == str(rank)
    ]
    assert len(found) == 1, found
    return found[0]


@pytest.mark.timeout(300)
def test_a_remote_rank_whose_heartbeat_is_held_is_busy_not_dead(
    tmp_path: Path, models_dir: Path, ssh_hosts: SshHosts, reference: list[str]
) -> None:
    """Rank 1's heartbeat thread stops for 30 s once its shard is loaded, while its
    process runs: a turn is asked and answered in that silence, past the 10 s
    heartbeat timeout, and the chat neither restarts nor ends."""
    home = home_with_models(tmp_path / "h", models_dir)
    chat = RemoteChat(home, ssh_hosts, 28700, EXOKV_TEST_HOLD_BEAT=f"1:{HOLD_S}", EXOKV_DEBUG="1")
    turns = [chat.send(SCRIPT[0])]
    held = chat.when("rank 1 holds its heartbeat", timeout=60)
    # The launcher relays both ranks through `ssh -tt`, whose stdin never refuses a
    # write: mlx.launch's relay spun on it for the whole chat (1.3 cores of this
    # machine while idle); exokv-launch waits for output instead (exokv.launch.paced).
    (launcher,) = [
        p for p in psutil.Process(chat.proc.pid).children() if "exokv-launch" in str(p.cmdline())
    ]
    before, tic = sum(launcher.cpu_times()[:2]), time.monotonic()
    time.sleep(max(0.0, held + 13 - time.monotonic()))  # silent past the 10 s timeout
    idle = (sum(launcher.cpu_times()[:2]) - before) / (time.monotonic() - tic)
    assert idle < IDLE_BOUND, f"the launcher used {idle:.0%} of a core while the chat idled"
    turns.append(chat.send(SCRIPT[1]))
    answered = time.monotonic()
    again = chat.when("rank 1 beats again", timeout=HOLD_S + 30)
    assert answered < again, chat.said()  # the turn ran while the beat was held
    turns.append(chat.send(SCRIPT[2]))
    assert chat.finish() == 0, chat.said()
    assert [t["reply"] for t in turns] == reference
    assert not [e for t in turns for e in t["events"] if e["kind"] == "restart"]
    trouble = [x for x in chat.lines() if "rank" in x and ("respond" in x or "again" in x)]
    assert trouble == [], chat.said()
    assert _ranks_left(home) == []


@pytest.mark.timeout(300)
def test_a_stopped_remote_rank_is_dead_and_replaced(
    tmp_path: Path, models_dir: Path, ssh_hosts: SshHosts, reference: list[str]
) -> None:
    """SIGSTOP of rank 1 on the other host between turns: one line names it as stopped
    (its host's watcher said so), the ranks start again, the stopped process is ended
    with its session, and the chat goes on with the undisturbed replies."""
    home = home_with_models(tmp_path / "h", models_dir)
    chat = RemoteChat(home, ssh_hosts, 28710)
    turns = [chat.send(SCRIPT[0])]
    time.sleep(1.0)  # the turn's files and journal record are written after its reply
    stopped = _rank_process(home, 1)
    stopped.suspend()
    at = time.monotonic()
    dead = chat.when("rank 1 stopped responding", timeout=60)
    print(f"rank 1 declared dead {dead - at:.1f} s after its SIGSTOP")  # -s shows it
    turns += [chat.send(line) for line in SCRIPT[1:]]
    assert chat.finish() == 0, chat.said()
    said = [x for x in chat.lines() if "rank 1" in x and "again" in x]
    assert said == [
        "exokv: rank 1 stopped responding (no heartbeat for 10 s; its process on "
        "'exokv-b' is stopped); the ranks start again with the next request"
    ], chat.said()
    assert [t["reply"] for t in turns] == reference
    assert len([e for e in turns[1]["events"] if e["kind"] == "restart"]) == 1
    assert not stopped.is_running() or stopped.status() == psutil.STATUS_ZOMBIE
    assert _ranks_left(home) == []


@pytest.mark.timeout(300)
def test_a_wedged_remote_rank_is_reported_by_rank_and_host(
    tmp_path: Path, models_dir: Path, ssh_hosts: SshHosts
) -> None:
    """Running but silent past the limit (shortened to 15 s here; 600 s for users):
    one line names the rank and its host, and the chat does not hang."""
    home = home_with_models(tmp_path / "h", models_dir)
    chat = RemoteChat(
        home,
        ssh_hosts,
        28720,
        "--restarts",
        "0",
        EXOKV_TEST_HOLD_BEAT="1:200",
        EXOKV_TEST_WEDGED_S="15",
    )
    assert chat.send(SCRIPT[0])["turn"] == 1
    assert chat.proc.wait(120) == 1, chat.said()  # stdin still open: it ends by itself
    time.sleep(0.5)
    wedged = [x for x in chat.lines() if "wedged" in x]
    assert len(wedged) == 1, chat.said()
    assert wedged == [
        "exokv: error: rank 1 on 'exokv-b' is wedged: its process runs but has said "
        "nothing for over 15 s"
    ], chat.said()
    chat.finish()
    assert _ranks_left(home) == []
