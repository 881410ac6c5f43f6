"""A Mac lost in the middle of a reply (tests/ssh_hosts.py `three_hosts`): the turn
runs again on the hosts left, its reply the one it would have given."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from chat_helpers import Chat
from test_host_gone import STORY, hostfile_of

pytestmark = pytest.mark.slow  # starts ranks over ssh: see tests/conftest.py

LONG = ("--max-tokens", "300")  # a reply long enough to lose a host in the middle of
LINES = [f"Hello there, tell me a story: {STORY}", " ".join([STORY] * 12)]


@pytest.mark.timeout(420)
def test_a_host_lost_in_the_middle_of_a_reply(tmp_path: Path, three_hosts) -> None:
    reference = Chat(tmp_path / "ref", *LONG)
    expected = [reference.send(line) for line in LINES]
    assert reference.finish()[0] == 0
    env = {"PATH": f"{three_hosts.bin_dir}:{os.environ['PATH']}"}
    three = hostfile_of(tmp_path / "three.json", ["exokv-a", "exokv-b", "exokv-c"])
    chat = Chat(
        tmp_path / "front", *LONG, "--hostfile", str(three), "--starting-port", "30440", env=env
    )
    first = chat.send(LINES[0])
    time.sleep(2.0)  # the first turn's replicas
    assert chat.proc.stdout is not None
    chat.write(LINES[1])
    time.sleep(1.0)  # into the turn: its prefill and reply take seconds on three hosts
    three_hosts.gone("exokv-c")
    second = json.loads(chat.proc.stdout.readline())
    code, err = chat.finish(timeout=120)
    assert code == 0, err
    restarts = [e for e in second["events"] if e["kind"] == "restart"]
    assert len(restarts) == 1 and "exokv-c is gone" in restarts[0]["reason"], second["events"]
    assert second["ranks"] == 2
    assert [first["reply"], second["reply"]] == [t["reply"] for t in expected]
