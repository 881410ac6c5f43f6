"""Which host keeps each rank's KV a second time, and which files move where after a
re-plan (exokv.hosts.replicas): pure rules, the same on every rank."""

from __future__ import annotations

import pytest

from exokv.hosts.replicas import (
    default_replicas,
    file_name,
    held_for,
    kv_moves,
    layer_ranges,
    parse_file_name,
    replica_targets,
)


def test_each_rank_copies_to_the_next_rank_on_another_host() -> None:
    assert replica_targets(["a", "b", "c"], 1) == [1, 2, 0]
    # Two ranks on one host keep no copies of each other: the next host's rank does.
    assert replica_targets(["a", "a", "b"], 1) == [2, 2, 0]
    assert held_for([2, 2, 0], 2) == [0, 1] and held_for([2, 2, 0], 1) == []


@pytest.mark.parametrize("hosts", [[None, None], ["a"], ["a", "a", "a"]])
def test_one_machine_keeps_no_replicas(hosts: list[str | None]) -> None:
    assert replica_targets(hosts, 1) == [None] * len(hosts)
    assert default_replicas(hosts) == 0


def test_replicas_0_turns_them_off() -> None:
    assert replica_targets(["a", "b"], 0) == [None, None]
    assert default_replicas(["a", "b"]) == 1


def test_layer_ranges_follow_the_pipeline_rank_0_last() -> None:
    assert layer_ranges([2, 1, 1]) == [(2, 4), (1, 2), (0, 1)]
    assert layer_ranges([4, 4], pipelined=False) == [(0, 4), (0, 4)]


@pytest.mark.parametrize("name", ["7.L0-4.kv", "123.L10-22.kv"], ids=["small", "large"])
def test_file_names_round_trip(name: str) -> None:
    parsed = parse_file_name(name)
    assert parsed is not None and file_name(*parsed) == name


@pytest.mark.parametrize(
    "name", ["7.kv", "7.L4-4.kv", "7.L4-2.kv", "x.L0-1.kv", "7.L0-1.tmp", "7.L0-.kv", "tree.json"]
)
def test_other_names_are_not_kv_files(name: str) -> None:
    assert parse_file_name(name) is None


def test_a_replan_moves_only_the_layers_a_host_lacks() -> None:
    # Three ranks [2, 1, 1] (a: 2-3, b: 1, c: 0), replicas 0->b, 1->c, 2->a; c is gone.
    held = {
        "a": ["5.L2-4.kv", "5.L0-1.kv"],  # its own, and c's copy
        "b": ["5.L1-2.kv", "5.L2-4.kv"],  # its own, and a's copy
    }
    moves = kv_moves(held, {"a": [(2, 4)], "b": [(0, 2)]})
    assert moves == [("a", "b", ["5.L0-1.kv"])]  # b runs 0-1 now: layer 0 is on a


def test_a_new_host_gets_every_layer_of_its_ranks_once() -> None:
    held = {"a": ["1.L0-2.kv", "2.L0-2.kv"], "b": ["1.L2-4.kv", "1.L0-2.kv"], "c": []}
    moves = dict(((s, d), n) for s, d, n in kv_moves(held, {"c": [(1, 3)]}))
    # Layers 1-2 of node 1: one file from a (the first that has it) holds 1, one from b 2.
    assert moves == {("a", "c"): ["1.L0-2.kv", "2.L0-2.kv"], ("b", "c"): ["1.L2-4.kv"]}


def test_nothing_moves_when_every_host_holds_its_layers() -> None:
    held = {"a": ["1.L0-4.kv"], "b": ["1.L0-4.kv"]}
    assert kv_moves(held, {"a": [(2, 4)], "b": [(0, 2)]}) == []
