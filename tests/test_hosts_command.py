"""`/hosts` in the chat: the hosts with their state and layers, and one taken on or left
out between turns (`/hosts add NAME`, `/hosts drop NAME`), on the three ssh hosts of
tests/ssh_hosts.py; its words on one machine and for bad input, without ranks."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from chat_helpers import Chat
from stub_client import StubClient
from test_host_gone import SCRIPT, hostfile_of

from exokv.chat.conversation import ChatController, TurnSettings
from exokv.core.records import HostState


class _Hosts(StubClient):
    def __init__(self) -> None:
        self.asked: list[dict[str, str | None]] = []

    def hosts(self) -> list[HostState]:
        return [HostState("mac-a", "up", [0], "11-21"), HostState("mac-c", "gone")]

    def change_hosts(self, add: str | None = None, drop: str | None = None) -> str:
        self.asked.append({"add": add, "drop": drop})
        return "mac-d joins; the chat goes on on mac-a, mac-d (layers 11-21, 0-10)"


def test_hosts_lists_and_changes_through_the_client() -> None:
    client = _Hosts()
    chat = ChatController(client, TurnSettings(), "s")  # type: ignore[arg-type]
    listed = chat.command("/hosts")
    assert listed.data == [
        {"host": "mac-a", "state": "up", "ranks": [0], "layers": "11-21"},
        {"host": "mac-c", "state": "gone", "ranks": [], "layers": ""},
    ]
    added = chat.command("/hosts add mac-d")
    assert not added.error and "mac-d joins" in added.message
    assert chat.command("/hosts drop mac-a").message.startswith("mac-d joins")
    assert client.asked == [{"add": "mac-d", "drop": None}, {"add": None, "drop": "mac-a"}]


@pytest.mark.parametrize("line", ["/hosts frob x", "/hosts add", "/hosts drop a b"])
def test_hosts_bad_words_get_the_usage(line: str) -> None:
    chat = ChatController(_Hosts(), TurnSettings(), "s")  # type: ignore[arg-type]
    out = chat.command(line)
    assert out.error and out.message == "usage: /hosts [add NAME | drop NAME]"


def test_hosts_on_one_machine_says_so() -> None:
    chat = ChatController(StubClient(), TurnSettings(), "s")  # type: ignore[arg-type]
    assert chat.command("/hosts").message == "this chat runs on one machine"
    out = chat.command("/hosts drop mac-b")
    assert out.error and out.message == "this fake runs on one machine"


@pytest.mark.slow  # starts ranks over ssh: see tests/conftest.py
@pytest.mark.timeout(420)
def test_a_host_taken_on_then_one_left_out_keeps_the_cache(tmp_path: Path, three_hosts) -> None:
    reference = Chat(tmp_path / "ref")
    expected = [reference.send(line) for line in SCRIPT]
    assert reference.finish()[0] == 0
    env = {"PATH": f"{three_hosts.bin_dir}:{os.environ['PATH']}"}
    two = hostfile_of(tmp_path / "two.json", ["exokv-a", "exokv-b"])
    chat = Chat(tmp_path / "front", "--hostfile", str(two), "--starting-port", "30480", env=env)
    turns = [chat.send(SCRIPT[0])]
    listed = chat.send("/hosts")
    assert [(h["host"], h["state"], h["ranks"]) for h in listed["data"]] == [
        ("exokv-a", "up", [0]),
        ("exokv-b", "up", [1]),
    ]
    assert all(h["layers"] for h in listed["data"])
    added = chat.send("/hosts add exokv-c")
    assert (
        added["ok"]
        and "exokv-c joins; the chat goes on on exokv-a, exokv-b, exokv-c" in (added["message"])
    ), added
    turns.append(chat.send(SCRIPT[1]))
    dropped = chat.send("/hosts drop exokv-a")
    assert dropped["ok"] and "exokv-a left the plan" in dropped["message"], dropped
    turns.append(chat.send(SCRIPT[2]))
    gone = chat.send("/hosts")
    code, err = chat.finish(timeout=120)
    assert code == 0, err
    assert [t["ranks"] for t in turns] == [2, 3, 2]
    assert [t["reply"] for t in turns] == [t["reply"] for t in expected[:3]]
    # Warm after each change, as an uninterrupted chat: the files went where the layers did.
    assert [t["cached_tokens"] for t in turns] == [t["cached_tokens"] for t in expected[:3]]
    assert [(h["host"], h["state"]) for h in gone["data"]] == [
        ("exokv-b", "up"),
        ("exokv-c", "up"),
        ("exokv-a", "dropped"),
    ]
