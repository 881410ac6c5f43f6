"""The three ssh hosts of tests/ssh_hosts.py (`three_hosts`): each its own sshd and
home, and one of them can go away for good, taking what was started on it along."""

from __future__ import annotations

import subprocess
import time

import psutil
import pytest
from ssh_hosts import THREE_HOSTS, ThreeHosts

pytestmark = pytest.mark.slow  # the ssh hosts (an sshd each): see tests/conftest.py

SLEEPS = ("600", "601", "602")  # in the session, setsid'd in the session, detached


def _ssh(hosts: ThreeHosts, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(hosts.bin_dir / "ssh"), *args],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=30,
    )


def _running_with_home(home: str) -> list[psutil.Process]:
    """Live processes (zombies are not) whose environment has HOME=home."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.status() != psutil.STATUS_ZOMBIE and p.environ().get("HOME") == home:
                found.append(p)
        except psutil.Error:
            continue
    return found


def _sleeps(home: str) -> set[str]:
    left = set()
    for p in _running_with_home(home):
        try:
            argv = p.cmdline()
        except psutil.Error:
            continue
        if len(argv) == 2 and argv[0].endswith("sleep") and argv[1] in SLEEPS:
            left.add(argv[1])
    return left


@pytest.mark.timeout(60)
def test_each_host_has_its_own_home(three_hosts: ThreeHosts) -> None:
    assert len(set(three_hosts.homes.values())) == 3
    for name, ip in THREE_HOSTS.items():
        done = _ssh(three_hosts, name, "echo", "$HOME", "$SSH_CONNECTION")
        assert done.returncode == 0, done.stderr
        home, *connection = done.stdout.split()
        assert home == str(three_hosts.homes[name])
        assert connection[2:] == [ip, str(three_hosts.port)]  # the server's end: its address
        assert three_hosts.is_up(name)


# Last in the file: the host stays gone for the rest of the module.
@pytest.mark.timeout(60)
def test_a_host_that_is_gone_takes_its_processes_along(three_hosts: ThreeHosts) -> None:
    ssh = str(three_hosts.bin_dir / "ssh")
    home = str(three_hosts.homes["exokv-c"])
    quiet = {"stdin": subprocess.DEVNULL, "stdout": subprocess.DEVNULL}
    clients = []
    try:
        # a plain command in its ssh session, and one in a session of its own (setsid)
        clients.append(subprocess.Popen([ssh, "exokv-c", "sleep", "600"], **quiet))
        clients.append(subprocess.Popen([ssh, "exokv-c", "setsid sleep 601 & wait"], **quiet))
        # fully detached: its ssh returns at once, it is no descendant of the sshd any more
        detach = _ssh(three_hosts, "exokv-c", "setsid -f sleep 602 </dev/null >/dev/null 2>&1")
        assert detach.returncode == 0, detach.stderr
        deadline = time.monotonic() + 20
        while _sleeps(home) != set(SLEEPS):
            assert time.monotonic() < deadline, f"only {_sleeps(home)} started"
            time.sleep(0.2)

        three_hosts.gone("exokv-c")

        assert _running_with_home(home) == []
        assert not three_hosts.is_up("exokv-c")
        for client in clients:  # their sessions went with the host
            assert client.wait(timeout=15) != 0
        refused = _ssh(three_hosts, "exokv-c", "true")
        assert refused.returncode != 0, refused.stdout
        for name in ("exokv-a", "exokv-b"):
            assert three_hosts.is_up(name)
            done = _ssh(three_hosts, name, "true")
            assert done.returncode == 0, done.stderr
    finally:
        for client in clients:
            if client.poll() is None:
                client.kill()
                client.wait(5)
        for p in _running_with_home(home):  # only if `gone` failed
            try:
                p.kill()
            except psutil.Error:
                pass
