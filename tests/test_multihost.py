"""Chats over real ssh: two "hosts" on the loopback addresses 127.0.0.1 and 127.0.0.2.

An sshd of our own (openssh-server; `.ci/run` installs it where it can) listens on
both addresses with a throw-away host key and a throw-away client key. `Host`
aliases in an ssh config of ours name the two hosts; a small `ssh` wrapper first
on PATH makes mlx.launch (which runs plain `ssh`) use that config. The ranks then
start exactly as on two Macs: over ssh, in a pseudo-terminal, with only the
hostfile's `envs` for environment. Everything is torn down after the module.
Skipped, with the reason, where the server cannot start.
"""

from __future__ import annotations

import getpass
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from chat_helpers import home_with_models

SSHD = "/usr/sbin/sshd"
SSH_PORT = 28022
HOSTS = {"exokv-a": "127.0.0.1", "exokv-b": "127.0.0.2"}
SCRIPT = ["Hello there", "Tell me about the sea", "Why is the sky blue"]


def _greets(address: str, port: int) -> bool:
    try:
        with socket.create_connection((address, port), timeout=1) as sock:
            return sock.recv(4) == b"SSH-"
    except OSError:
        return False


@pytest.fixture(scope="module")
def ssh_bin(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A folder to put first on PATH: its `ssh` reaches the two loopback hosts."""
    if not Path(SSHD).exists() or shutil.which("ssh") is None:
        pytest.skip("openssh-server is not installed (apt-get install openssh-server)")
    base = tmp_path_factory.mktemp("ssh")
    keygen = ["ssh-keygen", "-q", "-t", "ed25519", "-N", ""]
    subprocess.run([*keygen, "-f", str(base / "host_key")], check=True, timeout=30)
    subprocess.run([*keygen, "-f", str(base / "id")], check=True, timeout=30)
    shutil.copy(base / "id.pub", base / "authorized_keys")
    listen = "".join(f"ListenAddress {ip}:{SSH_PORT}\n" for ip in HOSTS.values())
    (base / "sshd_config").write_text(
        f"{listen}HostKey {base / 'host_key'}\n"
        f"AuthorizedKeysFile {base / 'authorized_keys'}\n"
        f"PidFile {base / 'sshd.pid'}\n"
        "PasswordAuthentication no\nKbdInteractiveAuthentication no\n"
        "PermitRootLogin prohibit-password\nUsePAM no\nStrictModes no\n"
    )
    aliases = "".join(f"Host {name}\n  HostName {ip}\n" for name, ip in HOSTS.items())
    (base / "ssh_config").write_text(
        f"{aliases}Host exokv-*\n  Port {SSH_PORT}\n  User {getpass.getuser()}\n"
        f"  IdentityFile {base / 'id'}\n  IdentitiesOnly yes\n  BatchMode yes\n"
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
        while not all(_greets(ip, SSH_PORT) for ip in HOSTS.values()):
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                why = (server.communicate(timeout=5)[1] or b"").decode().strip().splitlines()
                pytest.skip(f"sshd did not start: {why[-1] if why else 'no answer'}")
            time.sleep(0.1)
        probe = subprocess.run(
            [str(wrapper), "exokv-b", "echo", "ok"], capture_output=True, text=True, timeout=30
        )
        if probe.stdout.strip() != "ok":
            pytest.skip(f"ssh to the test server failed: {probe.stderr.strip()}")
        yield bin_dir
    finally:
        server.terminate()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()


def _hostfile(path: Path, home: Path, with_ips: bool) -> Path:
    hosts = [{"ssh": name, **({"ips": [ip]} if with_ips else {})} for name, ip in HOSTS.items()]
    # A remote rank sees only these variables: its home is this test's, like a shared disk.
    path.write_text(json.dumps({"hosts": hosts, "envs": [f"EXOKV_HOME={home}"]}))
    return path


def _chat(
    home: Path, ssh_bin: Path, hostfile: Path, port: int, *extra: str
) -> tuple[list[dict[str, Any]], str]:
    env = {**os.environ, "EXOKV_HOME": str(home), "PATH": f"{ssh_bin}:{os.environ['PATH']}"}
    env.pop("EXOKV_DEBUG", None)
    proc = subprocess.run(
        [sys.executable, "-m", "exokv", "chat", "-m", "builtin:tiny", "--json"]
        + ["--max-tokens", "8", "--hostfile", str(hostfile), "--starting-port", str(port)]
        + list(extra),
        input="\n".join(SCRIPT).encode() + b"\n",
        capture_output=True,
        env=env,
        timeout=150,
    )
    err = proc.stderr.decode()
    assert proc.returncode == 0, err
    return [json.loads(x) for x in proc.stdout.decode().splitlines()], err


def _ranks_left(home: Path) -> list[int]:
    """Processes still running with this test's home: ranks that outlived the chat."""
    deadline = time.monotonic() + 15
    while True:
        left = []
        for p in psutil.process_iter(["pid", "cmdline"]):
            try:
                if "exokv.rank.main" in " ".join(p.info["cmdline"] or []) and (
                    p.environ().get("EXOKV_HOME") == str(home)
                ):
                    left.append(p.pid)
            except psutil.Error:
                continue
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    ("parallel", "with_ips", "port"),
    [("pipeline", True, 28400), ("tensor", False, 28410)],
    ids=["pipeline-with-ips", "tensor-by-name"],
)
def test_a_chat_over_ssh_on_two_hosts(
    tmp_path: Path, models_dir: Path, ssh_bin: Path, parallel: str, with_ips: bool, port: int
) -> None:
    home = home_with_models(tmp_path / "h", models_dir)
    hostfile = _hostfile(tmp_path / "hosts.json", home, with_ips)
    turns, err = _chat(home, ssh_bin, hostfile, port, "--parallel", parallel)
    assert [t["turn"] for t in turns] == [1, 2, 3], err
    assert all(t["ranks"] == 2 for t in turns)
    assert turns[1]["cached_tokens"] > 0  # the prefix cache works across the two hosts
    # Both ranks kept their shard of the KV cache on quit, each in its own disk tier.
    trees = sorted(p.parent.name for p in (home / "kv").glob("*/*/rank*/tree.json"))
    assert trees == ["rank0", "rank1"]
    assert _ranks_left(home) == []


@pytest.mark.timeout(300)
def test_a_rank_killed_on_the_other_host_is_replaced(
    tmp_path: Path, models_dir: Path, ssh_bin: Path
) -> None:
    """SIGKILL of the rank on the second host between turns: one line, the ranks are
    started again over ssh, and the next turn is warm with the uninterrupted reply."""
    from chat_helpers import Chat
    from test_cluster import run_script

    reference = run_script(home_with_models(tmp_path / "ref", models_dir), SCRIPT)
    home = home_with_models(tmp_path / "h", models_dir)
    hostfile = _hostfile(tmp_path / "hosts.json", home, True)
    chat = Chat(
        home,
        *("--hostfile", str(hostfile), "--starting-port", "28430"),
        env={"PATH": f"{ssh_bin}:{os.environ['PATH']}"},
    )
    turns = [chat.send(SCRIPT[0])]
    time.sleep(1.0)  # the turn's files and journal record are written after its reply
    remote = [
        p
        for p in psutil.process_iter(["pid", "cmdline"])
        if "exokv.rank.main" in " ".join(p.info["cmdline"] or [])
        and p.environ().get("EXOKV_HOME") == str(home)
        and p.environ().get("MLX_RANK") == "1"
    ]
    assert len(remote) == 1
    remote[0].kill()
    time.sleep(3.0)  # the chat sees it at the prompt
    turns += [chat.send(line) for line in SCRIPT[1:]]
    code, err = chat.finish()
    assert code == 0, err
    said = [x for x in err.splitlines() if "rank 1" in x and "again" in x]
    assert len(said) == 1, err
    assert [t["reply"] for t in turns] == [t["reply"] for t in reference]
    restarted = [e for e in turns[1]["events"] if e["kind"] == "restart"]
    assert len(restarted) == 1, turns[1]["events"]
    assert turns[1]["cached_tokens"] == reference[1]["cached_tokens"] > 0  # warm from disk
    assert _ranks_left(home) == []
