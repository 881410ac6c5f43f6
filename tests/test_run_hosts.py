"""A run remembers the hosts its ranks ran on, so a session resumed on other hosts asks
those for the KV files of its layers (exokv.frontend.start, exokv.client.replan)."""

from __future__ import annotations

from pathlib import Path

from exokv.core.options import ClusterOptions
from exokv.frontend.start import with_earlier_hosts
from exokv.hosts.hostfile import Host, HostList
from exokv.state import Store
from tests.test_state import MESSAGES, MODEL, turn_result


def test_a_session_finds_the_hosts_it_ran_on_last(tmp_path: Path) -> None:
    with Store.open(tmp_path) as store:
        assert store.last_hosts("notes") == []  # never ran
        first = store.start_run(MODEL, 3, [None] * 3, ["mac-a", "mac-b", "mac-c"])
        store.record_turn(first, "notes", MESSAGES, turn_result(), MODEL)
        assert store.last_hosts("notes") == ["mac-a", "mac-b", "mac-c"]
        store.set_run_hosts(first, ["mac-a", "mac-b"])  # mac-c went: a re-plan
        assert store.last_hosts("notes") == ["mac-a", "mac-b"]
        other = store.start_run(MODEL, 1, [None])  # this machine alone, another session
        store.record_turn(other, "other", MESSAGES, turn_result(), MODEL)
        assert store.last_hosts("notes") == ["mac-a", "mac-b"]
        assert store.last_hosts("other") == []


def test_the_earlier_hosts_not_in_this_launch_are_its_kv_sources() -> None:
    hosts = HostList([Host("mac-a")])
    cluster = ClusterOptions(model=MODEL, hosts=hosts, rank_count=1)
    moved = with_earlier_hosts(cluster, ["mac-a", "mac-b"])
    assert moved.kv_sources == ("mac-b",)
    assert with_earlier_hosts(cluster, ["mac-a"]) is cluster
    alone = ClusterOptions(model=MODEL)  # no hosts: this machine's own files
    assert with_earlier_hosts(alone, ["mac-b"]) is alone
