"""`exokv serve` over three ssh hosts (tests/ssh_hosts.py `three_hosts`): a host gone
for good between requests is re-planned around while the server is idle, and the
next request is answered on the hosts left, as one rank answers it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from chat_helpers import Chat
from serve_helpers import conversation_replies, serving
from test_host_gone import SCRIPT, hostfile_of

pytestmark = pytest.mark.slow  # starts ranks over ssh: see tests/conftest.py


@pytest.mark.timeout(420)
def test_the_server_goes_on_without_a_host_that_is_gone(tmp_path: Path, three_hosts) -> None:
    reference = Chat(tmp_path / "ref")
    expected = [reference.send(line)["reply"] for line in SCRIPT[:3]]
    assert reference.finish()[0] == 0
    env = {"PATH": f"{three_hosts.bin_dir}:{os.environ['PATH']}"}
    three = hostfile_of(tmp_path / "three.json", ["exokv-a", "exokv-b", "exokv-c"])
    args = ("--hostfile", str(three), "--starting-port", "30500", "--max-tokens", "8")
    with serving(tmp_path / "srv", *args, env=env) as server:
        first = conversation_replies(server, SCRIPT[:2], "", 8)
        three_hosts.gone("exokv-c")
        said = server.wait_log(lambda x: "exokv-c is gone" in x, timeout=120)
        assert "the chat goes on on exokv-a, exokv-b" in said[0]
        again = conversation_replies(server, SCRIPT[:3], "", 8)
    assert [c.choices[0].message.content for c in first] == expected[:2]
    assert [c.choices[0].message.content for c in again] == expected
    details = again[2].usage.prompt_tokens_details
    assert details is not None and details.cached_tokens > 0  # warm on the hosts left
