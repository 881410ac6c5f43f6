"""Two ssh "hosts" on the loopback addresses 127.0.0.1 and 127.0.0.2, each with its own home.

An sshd of our own (openssh-server; `.ci/run` installs it where it can) listens on
both addresses with a throw-away host key and a throw-away client key. `Host`
aliases in an ssh config of ours name the two hosts; a small `ssh` wrapper first
on PATH makes mlx.launch (which runs plain `ssh`) use that config. The ranks then
start exactly as on two Macs: over ssh, in a pseudo-terminal, with only the
hostfile's `envs` for environment.

Each host's sessions get their own HOME (and so their own Hugging Face cache and,
unless a hostfile's envs say otherwise, their own `EXOKV_HOME`), sent with ssh's
the server's `SetEnv`: what one host downloaded is not visible on the other. A PYTHONPATH set
for the suite reaches the hosts too, so a worktree's code runs on them.

`three_hosts` is the same idea with three hosts (127.0.0.1-3), each served by an sshd
of its own, so that one of them can go away for good (`ThreeHosts.gone`): its sshd
and everything started through it are killed, and nothing listens on its address.

conftest.py offers the `ssh_hosts` and `three_hosts` fixtures to every test module.
Everything is torn down after the module. Skipped, with the reason, where the
server cannot start.
"""

from __future__ import annotations

import contextlib
import getpass
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

SSHD = "/usr/sbin/sshd"
# The first one free on every address is used. Each pytest-xdist worker starts on
# its own offset, so two workers never race for the same port. The two fixtures'
# ranges are apart from each other and from every rank port the suite passes.
_WORKER = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
SSH_PORTS = range(28022 + _WORKER % 7, 28100, 7)
THREE_PORTS = range(30022 + _WORKER % 7, 30100, 7)

HOSTS = {"exokv-a": "127.0.0.1", "exokv-b": "127.0.0.2"}
THREE_HOSTS = {**HOSTS, "exokv-c": "127.0.0.3"}


def _free_port(ports: range, addresses: Iterable[str]) -> int:
    """A port free on every host's address: two suites running at once (worktrees)
    each get their own sshd."""
    for port in ports:
        try:
            for ip in addresses:
                with socket.socket() as s:
                    s.bind((ip, port))
        except OSError:
            continue
        return port
    raise RuntimeError(f"no free port for the test sshd in {ports}")


@dataclass
class SshHosts:
    bin_dir: Path  # put first on PATH: its `ssh` reaches the hosts
    homes: dict[str, Path]  # each host's HOME, by ssh alias

    def env(self, **extra: str) -> dict[str, str]:
        """This process's environment with the wrapper first on PATH."""
        return {**os.environ, "PATH": f"{self.bin_dir}:{os.environ['PATH']}", **extra}


@dataclass
class ThreeHosts(SshHosts):
    port: int  # every host's sshd listens on it, on its own address
    servers: dict[str, subprocess.Popen[bytes]] = field(repr=False)  # each host's sshd

    def is_up(self, name: str) -> bool:
        """Whether the host's sshd runs and answers on its address."""
        return self.servers[name].poll() is None and _greets(THREE_HOSTS[name], self.port)

    def gone(self, name: str) -> None:
        """The host goes away for good: its sshd and every process started through it
        (however detached) are killed; a new ssh to it is refused."""
        _end_host(self.servers[name], self.homes[name])


# -- shared by both fixtures ------------------------------------------------------


def _make_keys(base: Path) -> None:
    """A host key, and a client key the server accepts (base/id, base/authorized_keys)."""
    keygen = ["ssh-keygen", "-q", "-t", "ed25519", "-N", ""]
    subprocess.run([*keygen, "-f", str(base / "host_key")], check=True, timeout=30)
    subprocess.run([*keygen, "-f", str(base / "id")], check=True, timeout=30)
    shutil.copy(base / "id.pub", base / "authorized_keys")


def _write_sshd_config(
    path: Path, base: Path, addresses: Iterable[str], port: int, pid_file: Path, tail: str
) -> Path:
    """An sshd config of base's keys listening on `addresses`; `tail` ends it."""
    listen = "".join(f"ListenAddress {ip}:{port}\n" for ip in addresses)
    path.write_text(
        f"{listen}HostKey {base / 'host_key'}\n"
        f"AuthorizedKeysFile {base / 'authorized_keys'}\n"
        f"PidFile {pid_file}\n"
        "PasswordAuthentication no\nKbdInteractiveAuthentication no\n"
        "PermitRootLogin prohibit-password\nUsePAM no\nStrictModes no\n"
        f"AcceptEnv PYTHONPATH\n{tail}"
    )
    return path


def _write_client(base: Path, hosts: dict[str, str], port: int) -> Path:
    """The ssh config naming `hosts` and the `ssh` wrapper using it: the wrapper's path."""
    pythonpath = os.environ.get("PYTHONPATH", "")
    sent = f"  SetEnv PYTHONPATH={pythonpath}\n" if pythonpath else ""
    aliases = "".join(f"Host {name}\n  HostName {ip}\n" for name, ip in hosts.items())
    (base / "ssh_config").write_text(
        f"{aliases}Host exokv-*\n  Port {port}\n  User {getpass.getuser()}\n"
        f"  IdentityFile {base / 'id'}\n  IdentitiesOnly yes\n  BatchMode yes\n{sent}"
        "  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n  LogLevel ERROR\n"
    )
    bin_dir = base / "bin"
    bin_dir.mkdir()
    wrapper = bin_dir / "ssh"
    wrapper.write_text(f'#!/bin/sh\nexec {shutil.which("ssh")} -F {base / "ssh_config"} "$@"\n')
    wrapper.chmod(0o755)
    return wrapper


def _start_sshd(config: Path, log: Path | None = None) -> subprocess.Popen[bytes]:
    """sshd in the foreground; its log to `log`, or to a pipe read if it does not start."""
    if os.geteuid() == 0:
        Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege separation folder
    command = [SSHD, "-D", "-e", "-f", str(config)]
    if log is None:
        return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    with log.open("wb") as stderr:
        return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr)


def _greets(address: str, port: int) -> bool:
    try:
        with socket.create_connection((address, port), timeout=1) as sock:
            return sock.recv(4) == b"SSH-"
    except OSError:
        return False


def _await_greetings(
    servers: list[tuple[subprocess.Popen[bytes], str, Path | None]], port: int
) -> None:
    """Until each (server, address, log) greets on its address; skipped, with the
    server's last words, if one exits or none greets within 15 s."""
    deadline = time.monotonic() + 15
    while True:
        waiting = [(s, log) for s, ip, log in servers if not _greets(ip, port)]
        if not waiting:
            return
        for server, log in waiting:
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                why = server.communicate(timeout=5)[1] or b""
                if log is not None:
                    why = log.read_bytes()
                lines = why.decode(errors="replace").strip().splitlines()
                pytest.skip(f"sshd did not start: {lines[-1] if lines else 'no answer'}")
        time.sleep(0.1)


def _probe_home(wrapper: Path, name: str, home: Path) -> None:
    """ssh to `name` works and its sessions' HOME is `home`; skipped if ssh fails."""
    probe = subprocess.run(
        [str(wrapper), name, "echo", "$HOME"], capture_output=True, text=True, timeout=30
    )
    if probe.returncode != 0:
        pytest.skip(f"ssh to the test server failed: {probe.stderr.strip()}")
    # The homes are the point of these hosts: a server that ignores SetEnv fails here.
    assert probe.stdout.strip() == str(home), probe.stdout


# -- the two hosts ------------------------------------------------------------------


@pytest.fixture(scope="module")
def ssh_hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshHosts]:
    """The two hosts, their homes made afresh for each test module."""
    if not Path(SSHD).exists() or shutil.which("ssh") is None:
        pytest.skip("openssh-server is not installed (apt-get install openssh-server)")
    base = tmp_path_factory.mktemp("ssh")
    _make_keys(base)
    port = _free_port(SSH_PORTS, HOSTS.values())
    homes = {name: base / f"home-{name}" for name in HOSTS}
    for home in homes.values():
        home.mkdir()
    # sshd sets HOME after what a client sends, so each address's HOME is the server's.
    per_host = "".join(
        f"Match LocalAddress {ip}\n  SetEnv HOME={homes[name]}\n" for name, ip in HOSTS.items()
    )
    config = _write_sshd_config(
        base / "sshd_config", base, HOSTS.values(), port, base / "sshd.pid", per_host
    )
    wrapper = _write_client(base, HOSTS, port)
    server = _start_sshd(config)
    try:
        _await_greetings([(server, ip, None) for ip in HOSTS.values()], port)
        _probe_home(wrapper, "exokv-b", homes["exokv-b"])
        yield SshHosts(wrapper.parent, homes)
    finally:
        server.terminate()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()


# -- the three hosts, each its own sshd ---------------------------------------------


def _with_home(home: str) -> set[psutil.Process]:
    """Every process (but this one) whose environment has HOME=home."""
    found = set()
    for p in psutil.process_iter():
        if p.pid == os.getpid():
            continue
        try:
            if p.environ().get("HOME") == home:
                found.add(p)
        except psutil.Error:
            continue
    return found


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _end_host(server: subprocess.Popen[bytes], home: Path, timeout: float = 10.0) -> None:
    """Kill a host's sshd and every process started through it, and wait until they
    are gone (RuntimeError after `timeout` s if some are not).

    The sshd is stopped (SIGSTOP) first, so it accepts and forks no more. Then its
    descendants (per-connection sshd, the user's shell and commands, setsid or not)
    and every process whose HOME is the host's (the detached ones that left the tree)
    are stopped too, round after round until a round finds no new one: a stopped
    process forks no more. Then all get SIGKILL."""
    deadline = time.monotonic() + timeout
    stopped: set[psutil.Process] = set()
    if server.poll() is None:
        try:
            sshd = psutil.Process(server.pid)
            sshd.suspend()
            stopped.add(sshd)
        except psutil.Error:
            pass
    while time.monotonic() < deadline:
        found = _with_home(str(home))
        for p in stopped:
            try:
                found.update(p.children(recursive=True))
            except psutil.Error:
                continue
        new = found - stopped
        if not new:
            break
        for p in new:
            try:
                p.suspend()
            except psutil.Error:
                pass
        stopped |= new
    for p in stopped:
        try:
            p.kill()
        except psutil.Error:
            pass
    if server.poll() is None:
        server.kill()
    try:
        server.wait(max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    while True:
        left = {p for p in stopped | _with_home(str(home)) if _alive(p)}
        if not left:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"still running after the host went: {sorted(p.pid for p in left)}")
        for p in left:
            try:
                p.kill()
            except psutil.Error:
                pass
        time.sleep(0.1)


def _bindable(address: str) -> bool:
    try:
        with socket.socket() as s:
            s.bind((address, 0))
    except OSError:
        return False
    return True


class HostsUnavailable(Exception):
    """The three hosts cannot be had here (no sshd, no 127.0.0.3): the reason."""


@contextlib.contextmanager
def three_hosts_at(base: Path) -> Iterator[ThreeHosts]:
    """Three hosts, exokv-a/-b/-c on 127.0.0.1/2/3, each served by an sshd of its own
    (so `gone` can take one away for good), their homes under `base`; ended on exit.
    Used by the `three_hosts` fixture and by benchmarks/replicas.py."""
    if not Path(SSHD).exists() or shutil.which("ssh") is None:
        raise HostsUnavailable("openssh-server is not installed (apt-get install openssh-server)")
    unbound = [ip for ip in THREE_HOSTS.values() if not _bindable(ip)]
    if unbound:
        raise HostsUnavailable(f"cannot bind {', '.join(unbound)} (no such loopback address here)")
    _make_keys(base)
    port = _free_port(THREE_PORTS, THREE_HOSTS.values())
    homes = {name: base / f"home-{name}" for name in THREE_HOSTS}
    servers: dict[str, subprocess.Popen[bytes]] = {}
    wrapper = _write_client(base, THREE_HOSTS, port)
    try:
        for name, ip in THREE_HOSTS.items():
            homes[name].mkdir()
            # One address each: the host's HOME is simply the server's SetEnv.
            config = _write_sshd_config(
                base / f"sshd_config-{name}",
                base,
                [ip],
                port,
                base / f"sshd-{name}.pid",
                f"SetEnv HOME={homes[name]}\n",
            )
            servers[name] = _start_sshd(config, base / f"sshd-{name}.log")
        _await_greetings(
            [(servers[name], ip, base / f"sshd-{name}.log") for name, ip in THREE_HOSTS.items()],
            port,
        )
        for name in THREE_HOSTS:
            _probe_home(wrapper, name, homes[name])
        yield ThreeHosts(wrapper.parent, homes, port, servers)
    finally:
        failures = []
        for name, server in servers.items():
            try:
                _end_host(server, homes[name])
            except RuntimeError as e:
                failures.append(f"{name}: {e}")
        if failures:
            raise RuntimeError("; ".join(failures))


@pytest.fixture(scope="module")
def three_hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThreeHosts]:
    """The three hosts of `three_hosts_at`, made afresh for each test module."""
    try:
        with three_hosts_at(tmp_path_factory.mktemp("ssh3")) as hosts:
            yield hosts
    except HostsUnavailable as why:
        pytest.skip(str(why))
