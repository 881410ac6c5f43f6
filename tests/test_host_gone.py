"""A Mac that leaves for good: three ssh hosts (tests/ssh_hosts.py `three_hosts`), each
with its own sshd and its own home, pipeline ranks on all three; host C goes away
(its sshd and every process under it killed) and the chat goes on on A and B with
its cache, read from their own files and the replicas of C's.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
from chat_helpers import Chat
from ssh_hosts import THREE_HOSTS, ThreeHosts

from exokv.hosts.replicas import parse_file_name

pytestmark = pytest.mark.slow  # starts ranks over ssh: see tests/conftest.py

# A chat whose earlier turns are most of the third turn's prompt, as in a long chat.
STORY = (
    "the sea was grey and the long waves rolled in from the west, one after another, "
    "while the old ships with their patched sails came home to the harbour at dusk "
)
SCRIPT = [
    f"Hello there, tell me a story: {STORY * 2}",
    f"Tell me more: {STORY * 2}",
    "Why?",
    "And then?",  # the next day, on the two hosts left
    "And after that?",  # on host A alone: B, where it ran last, lends its layers' files
]


def hostfile_of(path: Path, names: list[str]) -> Path:
    hosts = [{"ssh": name, "ips": [THREE_HOSTS[name]]} for name in names]
    path.write_text(json.dumps({"hosts": hosts}))
    return path


def _pools(hosts: ThreeHosts, name: str) -> list[Path]:
    """The KV files host `name` keeps (its own and replicas), under its own home."""
    return sorted(hosts.homes[name].rglob("kv/*/*/pool-*/*.kv"))


def _wait_for(check: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.2)
    return False


@pytest.mark.timeout(420)
def test_a_host_gone_for_good_the_chat_goes_on_with_its_cache(
    tmp_path: Path, three_hosts: ThreeHosts
) -> None:
    reference = Chat(tmp_path / "ref")
    expected = [reference.send(line) for line in SCRIPT]
    assert reference.finish()[0] == 0
    env = {"PATH": f"{three_hosts.bin_dir}:{os.environ['PATH']}"}
    hostfile = hostfile_of(tmp_path / "three.json", ["exokv-a", "exokv-b", "exokv-c"])
    chat = Chat(
        tmp_path / "front",
        *("--hostfile", str(hostfile), "--starting-port", "30400", "--session", "notes"),
        env=env,
    )
    turns = [chat.send(line) for line in SCRIPT[:2]]
    assert [t["ranks"] for t in turns] == [3, 3], chat.stderr(0)
    # Every host keeps its own files and a replica of the rank before it in the ring
    # (rank 2's copy goes to rank 0): once the last turn's copies are done, every file
    # C holds is on A or B too.
    on_c = {p.name for p in _pools(three_hosts, "exokv-c")}
    assert on_c, "host C wrote no disk tier files"

    def elsewhere() -> set[str]:
        return {p.name for name in ("exokv-a", "exokv-b") for p in _pools(three_hosts, name)}

    assert _wait_for(lambda: on_c <= elsewhere(), 60), on_c - elsewhere()
    # A replica is its owner's file byte for byte.
    for path in _pools(three_hosts, "exokv-c"):
        copies = [
            p
            for name in ("exokv-a", "exokv-b")
            for p in _pools(three_hosts, name)
            if p.name == path.name
        ]
        assert copies and all(c.read_bytes() == path.read_bytes() for c in copies), path.name
    three_hosts.gone("exokv-c")
    third = chat.send(SCRIPT[2])
    code, err = chat.finish(timeout=120)
    assert code == 0, err
    assert third["ranks"] == 2, err
    assert third["reply"] == expected[2]["reply"]  # as one rank answers it, at temperature 0
    assert third["cached_tokens"] >= 0.9 * third["prompt_tokens"], (third, err)
    said = [line for line in err.splitlines() if "is gone" in line]
    assert len(said) == 1 and "exokv-c is gone; the chat goes on on exokv-a, exokv-b" in said[0]
    assert "cache kept" in said[0], err

    # The next day: the same session on the two hosts left, from a hostfile of its own.
    _resumed(tmp_path, env, ["exokv-a", "exokv-b"], "30420", SCRIPT[3], expected[3])
    # On host A alone: every layer's files are needed there; B has those A lacks.
    _resumed(tmp_path, env, ["exokv-a"], "30430", SCRIPT[4], expected[4])
    # Every layer of every entry on A now: its own files, replicas, and what B lent.
    layers: dict[int, set[int]] = {}
    for p in _pools(three_hosts, "exokv-a"):
        parsed = parse_file_name(p.name)
        assert parsed is not None, p.name
        layers.setdefault(parsed[0], set()).update(range(*parsed[1]))
    assert all(held == set(range(4)) for held in layers.values()), layers


def _resumed(
    tmp_path: Path, env: dict[str, str], names: list[str], port: str, line: str, expected: Any
) -> None:
    """Session `notes` resumed on `names` alone: one turn, warm, as one rank answers it."""
    hostfile = hostfile_of(tmp_path / f"{len(names)}-hosts.json", names)
    chat = Chat(
        tmp_path / "front",
        *("--hostfile", str(hostfile), "--starting-port", port, "--session", "notes"),
        env=env,
    )
    turn = chat.send(line)
    code, err = chat.finish(timeout=120)
    assert code == 0, err
    assert turn["ranks"] == len(names) and turn["reply"] == expected["reply"]
    assert turn["cached_tokens"] >= 0.9 * turn["prompt_tokens"], (turn, err)
