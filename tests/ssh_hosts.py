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

conftest.py offers the `ssh_hosts` fixture to every test module.
Everything is torn down after the module. Skipped, with the reason, where the
server cannot start.
"""

from __future__ import annotations

import getpass
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

SSHD = "/usr/sbin/sshd"
# The first one free on both addresses is used. Each pytest-xdist worker starts on
# its own offset, so two workers never race for the same port.
_WORKER = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
SSH_PORTS = range(28022 + _WORKER % 7, 28100, 7)


def _free_port() -> int:
    """A port free on every host's address: two suites running at once (worktrees)
    each get their own sshd."""
    for port in SSH_PORTS:
        try:
            for ip in HOSTS.values():
                with socket.socket() as s:
                    s.bind((ip, port))
        except OSError:
            continue
        return port
    raise RuntimeError(f"no free port for the test sshd in {SSH_PORTS}")


HOSTS = {"exokv-a": "127.0.0.1", "exokv-b": "127.0.0.2"}


@dataclass
class SshHosts:
    bin_dir: Path  # put first on PATH: its `ssh` reaches the hosts
    homes: dict[str, Path]  # each host's HOME, by ssh alias

    def env(self, **extra: str) -> dict[str, str]:
        """This process's environment with the wrapper first on PATH."""
        return {**os.environ, "PATH": f"{self.bin_dir}:{os.environ['PATH']}", **extra}


def _greets(address: str, port: int) -> bool:
    try:
        with socket.create_connection((address, port), timeout=1) as sock:
            return sock.recv(4) == b"SSH-"
    except OSError:
        return False


@pytest.fixture(scope="module")
def ssh_hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshHosts]:
    """The two hosts, their homes made afresh for each test module."""
    if not Path(SSHD).exists() or shutil.which("ssh") is None:
        pytest.skip("openssh-server is not installed (apt-get install openssh-server)")
    base = tmp_path_factory.mktemp("ssh")
    keygen = ["ssh-keygen", "-q", "-t", "ed25519", "-N", ""]
    subprocess.run([*keygen, "-f", str(base / "host_key")], check=True, timeout=30)
    subprocess.run([*keygen, "-f", str(base / "id")], check=True, timeout=30)
    shutil.copy(base / "id.pub", base / "authorized_keys")
    port = _free_port()
    listen = "".join(f"ListenAddress {ip}:{port}\n" for ip in HOSTS.values())
    homes = {name: base / f"home-{name}" for name in HOSTS}
    for home in homes.values():
        home.mkdir()
    # sshd sets HOME after what a client sends, so each address's HOME is the server's.
    per_host = "".join(
        f"Match LocalAddress {ip}\n  SetEnv HOME={homes[name]}\n" for name, ip in HOSTS.items()
    )
    (base / "sshd_config").write_text(
        f"{listen}HostKey {base / 'host_key'}\n"
        f"AuthorizedKeysFile {base / 'authorized_keys'}\n"
        f"PidFile {base / 'sshd.pid'}\n"
        "PasswordAuthentication no\nKbdInteractiveAuthentication no\n"
        "PermitRootLogin prohibit-password\nUsePAM no\nStrictModes no\n"
        f"AcceptEnv PYTHONPATH\n{per_host}"
    )
    pythonpath = os.environ.get("PYTHONPATH", "")
    sent = f"  SetEnv PYTHONPATH={pythonpath}\n" if pythonpath else ""
    aliases = "".join(f"Host {name}\n  HostName {ip}\n" for name, ip in HOSTS.items())
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
    if os.geteuid() == 0:
        Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege separation folder
    server = subprocess.Popen(
        [SSHD, "-D", "-e", "-f", str(base / "sshd_config")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 15
        while not all(_greets(ip, port) for ip in HOSTS.values()):
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                why = (server.communicate(timeout=5)[1] or b"").decode().strip().splitlines()
                pytest.skip(f"sshd did not start: {why[-1] if why else 'no answer'}")
            time.sleep(0.1)
        probe = subprocess.run(
            [str(wrapper), "exokv-b", "echo", "$HOME"], capture_output=True, text=True, timeout=30
        )
        if probe.returncode != 0:
            pytest.skip(f"ssh to the test server failed: {probe.stderr.strip()}")
        # The homes are the point of these hosts: a server that ignores SetEnv fails here.
        assert probe.stdout.strip() == str(homes["exokv-b"]), probe.stdout
        yield SshHosts(bin_dir, homes)
    finally:
        server.terminate()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()
