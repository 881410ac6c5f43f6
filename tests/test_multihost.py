"""Chats over real ssh on the two loopback "hosts" of tests/ssh_hosts.py.

The ranks start exactly as on two Macs: over ssh, in a pseudo-terminal, with only
the hostfile's `envs` for environment (here an EXOKV_HOME shared by both hosts,
like a shared disk). Skipped, with the reason, where no sshd can start.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
from chat_helpers import home_with_models
from ssh_hosts import HOSTS, SshHosts

pytestmark = pytest.mark.slow  # starts ranks, servers or real models: see tests/conftest.py

SCRIPT = ["Hello there", "Tell me about the sea", "Why is the sky blue"]


def _hostfile(path: Path, home: Path, with_ips: bool) -> Path:
    hosts = [{"ssh": name, **({"ips": [ip]} if with_ips else {})} for name, ip in HOSTS.items()]
    # A remote rank sees only these variables: its home is this test's, like a shared disk.
    path.write_text(json.dumps({"hosts": hosts, "envs": [f"EXOKV_HOME={home}"]}))
    return path


def _chat(
    home: Path, ssh_hosts: SshHosts, hostfile: Path, port: int, *extra: str
) -> tuple[list[dict[str, Any]], str]:
    env = {
        **os.environ,
        "EXOKV_HOME": str(home),
        "PATH": f"{ssh_hosts.bin_dir}:{os.environ['PATH']}",
    }
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
    """Processes still running with this test's home: ranks (or their watchers) that
    outlived the chat."""
    deadline = time.monotonic() + 15
    while True:
        left = []
        for p in psutil.process_iter(["pid", "cmdline"]):
            try:
                command = " ".join(p.info["cmdline"] or [])
                if ("exokv.rank.main" in command or "exokv.launch.watcher" in command) and (
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
    tmp_path: Path, models_dir: Path, ssh_hosts: SshHosts, parallel: str, with_ips: bool, port: int
) -> None:
    home = home_with_models(tmp_path / "h", models_dir)
    hostfile = _hostfile(tmp_path / "hosts.json", home, with_ips)
    turns, err = _chat(home, ssh_hosts, hostfile, port, "--parallel", parallel)
    assert [t["turn"] for t in turns] == [1, 2, 3], err
    assert all(t["ranks"] == 2 for t in turns)
    assert turns[1]["cached_tokens"] > 0  # the prefix cache works across the two hosts
    # Both ranks kept their shard of the KV cache on quit, each in its own disk tier.
    trees = sorted(p.parent.name for p in (home / "kv").glob("*/*/rank*/tree.json"))
    assert trees == ["rank0", "rank1"]
    assert _ranks_left(home) == []


@pytest.mark.timeout(300)
def test_a_rank_killed_on_the_other_host_is_replaced(
    tmp_path: Path, models_dir: Path, ssh_hosts: SshHosts
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
        env={"PATH": f"{ssh_hosts.bin_dir}:{os.environ['PATH']}"},
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


@pytest.mark.timeout(200)
def test_a_remote_ranks_own_error_is_the_line_the_chat_shows(
    tmp_path: Path, models_dir: Path, ssh_hosts: SshHosts
) -> None:
    """Under `ssh -tt` a remote rank's stderr reaches the launcher's stdout: its one-line
    error is still the one the chat shows, not "rank 1 exited with code 1"."""
    home = home_with_models(tmp_path / "h", models_dir)
    hostfile = _hostfile(tmp_path / "hosts.json", home, True)
    env = {
        **ssh_hosts.env(EXOKV_HOME=str(home), EXOKV_TEST_FAIL_AT="1:prefill"),
    }
    env.pop("EXOKV_DEBUG", None)
    proc = subprocess.run(
        [sys.executable, "-m", "exokv", "chat", "-m", "builtin:tiny", "--json", "--restarts", "0"]
        + ["--hostfile", str(hostfile), "--starting-port", "28440"],
        input=b"Hello there\n",
        capture_output=True,
        env=env,
        timeout=150,
    )
    err = proc.stderr.decode()
    assert proc.returncode == 1, err
    assert "rank 1 failed: RuntimeError: injected failure in prefill" in err, err
    assert _ranks_left(home) == []
