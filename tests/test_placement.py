"""exokv.hosts.placement: layers placed in proportion to what each rank can hold, the budgets
from what is left, and a refusal that says by how much (pure: no model, no ranks)."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from exokv.errors import UsageError
from exokv.hosts.placement import (
    DoesNotFit,
    ModelSizes,
    RankRoom,
    cache_budget,
    even_split,
    local_range,
    place,
    place_tensor,
    plan_split,
)

GB = 10**9
MB = 10**6


def uniform(layers: int, weight: int, shared: int = 0, kv: int = 1000) -> ModelSizes:
    return ModelSizes([weight] * layers, shared, [kv] * layers)


def test_uneven_hosts_get_layers_in_proportion_rank_0_the_last():
    rooms = [RankRoom("a", 24 * GB), RankRoom("b", 8 * GB)]
    plan = place(rooms, uniform(32, 100 * MB, kv=100_000), 0.9, min_tokens=2048)
    assert plan.split == [24, 8]
    # mlx-lm's order: rank 1 runs layers 0-7, rank 0 the last 24.
    assert [r.layers for r in plan.rows] == [(8, 32), (0, 8)]
    assert [r.layers for r in plan.rows] == [local_range(plan.split, r) for r in range(2)]
    assert plan.source == "auto" and plan.parallel == "pipeline"
    # The embedding and head on every rank take a larger share of the small host.
    heavy = place(rooms, uniform(32, 100 * MB, shared=500 * MB, kv=100_000), 0.9)
    assert heavy.split == [25, 7]


def test_equal_hosts_split_evenly_and_four_layers_go_3_1_on_24_and_8_gb():
    sizes = uniform(4, 200_000, shared=600_000, kv=256)
    even = place([RankRoom("a", 8 * GB), RankRoom("b", 8 * GB)], sizes, 0.9)
    assert even.split == even_split(4, 2) == [2, 2]
    assert place([RankRoom("a", 24 * GB), RankRoom("b", 8 * GB)], sizes, 0.9).split == [3, 1]
    assert place([RankRoom("a", 8 * GB), RankRoom("b", 24 * GB)], sizes, 0.9).split == [1, 3]


def test_budget_is_what_is_left_of_the_threshold_and_free_after_the_rest():
    sizes = uniform(4, 10 * MB, shared=30 * MB, kv=1000)
    plan = place([RankRoom("a", 3 * GB), RankRoom("b", GB)], sizes, 0.8)
    for row, room in zip(plan.rows, [3 * GB, GB], strict=True):
        start, end = row.layers
        assert row.weights == 30 * MB + 10 * MB * (end - start)  # the shared tensors on each
        assert row.budget == int(0.8 * room) - row.weights == cache_budget(0.8, room, row.weights)
        assert row.free_after == room - row.weights - row.budget
    assert plan.budgets == [r.budget for r in plan.rows]
    assert plan.cache_tokens == min(r.budget // r.kv_per_token for r in plan.rows)


def test_ranks_sharing_a_host_share_its_memory():
    sizes = uniform(6, 10 * MB, kv=1000)
    rooms = [RankRoom("big", 16 * GB, sharing=2)] * 2 + [RankRoom("small", 8 * GB)]
    plan = place(rooms, sizes, 1.0)
    assert [r.memory for r in plan.rows] == [8 * GB] * 3
    assert plan.split == [2, 2, 2]


def test_shared_tensors_count_only_where_held():
    sizes = uniform(4, 10 * MB, shared=100 * MB)
    plan = place([RankRoom("a", GB), RankRoom("b", GB)], sizes, 1.0, shared_on={0})
    assert plan.rows[0].weights == 100 * MB + 10 * MB * plan.split[0]
    assert plan.rows[1].weights == 10 * MB * plan.split[1]


def test_a_heavy_layer_moves_the_cut():
    # Layer 0 (rank 1's first) weighs as much as the other three together.
    sizes = ModelSizes([300 * MB, 100 * MB, 100 * MB, 100 * MB], 0, [0] * 4)
    plan = place([RankRoom("a", GB), RankRoom("b", GB)], sizes, 0.5, min_tokens=0)
    assert plan.split == [3, 1]


def _best_tokens(caps: list[int], sizes: ModelSizes) -> int:
    """The most cached tokens any split allows, by trying every split."""
    n, layers = len(caps), len(sizes.layers)
    best = -1
    for cuts in itertools.combinations(range(1, layers), n - 1):
        bounds = [0, *cuts, layers]
        tokens = []
        for k in range(n):  # segment k is rank n-1-k's
            lo, hi = bounds[k], bounds[k + 1]
            room = caps[n - 1 - k] - sum(sizes.layers[lo:hi])
            tokens.append(room // sum(sizes.kv_per_token[lo:hi]) if room >= 0 else -1)
        best = max(best, min(tokens))
    return best


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.integers(1, 40), min_size=2, max_size=7),
    st.lists(st.integers(5, 200), min_size=1, max_size=3),
    st.integers(0, 30),
    st.integers(1, 5),
)
def test_the_plan_holds_as_many_tokens_as_the_best_split(layer_mb, host_mb, shared_mb, kv):
    layers = [w * MB for w in layer_mb]
    sizes = ModelSizes(layers, shared_mb * MB, [kv * 1000] * len(layers))
    rooms = [RankRoom(f"h{i}", m * 10 * MB) for i, m in enumerate(host_mb)]
    if len(rooms) > len(layers):
        with pytest.raises(UsageError):
            place(rooms, sizes, 0.9, min_tokens=0)
        return
    caps = [int(0.9 * r.memory) - sizes.shared for r in rooms]
    best = _best_tokens(caps, sizes)
    if best < 16:
        with pytest.raises(DoesNotFit):
            place(rooms, sizes, 0.9, min_tokens=16)
        return
    plan = place(rooms, sizes, 0.9, min_tokens=16)
    assert plan.cache_tokens == best
    assert sum(plan.split) == len(layers) and min(plan.split) >= 1
    assert all(r.free_after >= 0 for r in plan.rows)


def test_a_model_too_big_is_refused_by_how_much():
    sizes = uniform(4, GB, shared=GB, kv=1000)  # 4 GB of layers, 1 GB shared on each rank
    rooms = [RankRoom("a", 3 * GB), RankRoom("b", 3 * GB)]
    with pytest.raises(DoesNotFit) as caught:
        place(rooms, sizes, 0.9, min_tokens=1000)
    need = 4 * GB + 2 * GB + 1000 * 4 * 1000
    have = 2 * int(0.9 * 3 * GB)
    assert caught.value.short == need - have
    message = str(caught.value)
    assert "does not fit" in message and "short" in message and "\n" not in message
    assert caught.value.exit_code == 2
    # That much more memory (at the threshold), and it fits; a little less, and it does not.
    more = caught.value.short / 0.9 / 2
    place([RankRoom(r.host, int(r.memory + more) + 10) for r in rooms], sizes, 0.9, min_tokens=1000)
    with pytest.raises(DoesNotFit):
        place([RankRoom(r.host, int(r.memory + more) - MB) for r in rooms], sizes, 0.9,
              min_tokens=1000)  # fmt: skip


def test_a_host_too_small_for_one_layer_is_named():
    sizes = uniform(4, 100 * MB, shared=100 * MB, kv=1000)
    with pytest.raises(DoesNotFit) as caught:
        place([RankRoom("big", 64 * GB), RankRoom("tiny", 150 * MB)], sizes, 1.0, min_tokens=100)
    assert "rank 1 on tiny" in str(caught.value)
    assert caught.value.short == 100 * MB + 100 * MB + 100 * 1000 - 150 * MB


def test_more_ranks_than_layers_is_a_usage_error():
    with pytest.raises(UsageError, match="at most one rank per layer"):
        place([RankRoom("a", GB)] * 3, uniform(2, MB), 0.9)


def test_a_given_split_is_planned_as_given_and_checked():
    sizes = uniform(4, 100 * MB, kv=1000)
    plan = plan_split([RankRoom("a", GB), RankRoom("b", GB)], sizes, [3, 1], 0.9)
    assert plan.split == [3, 1] and plan.source == "given"
    assert [r.layers for r in plan.rows] == [(1, 4), (0, 1)]
    assert plan.short() == []
    tight = plan_split([RankRoom("a", 200 * MB), RankRoom("b", GB)], sizes, [3, 1], 0.9)
    assert tight.rows[0].budget == 0 and tight.short() == ["rank 0 on a: 100 MB short"]
    with pytest.raises(UsageError, match="adds up to 3 layers; the model has 4"):
        plan_split([RankRoom("a", GB), RankRoom("b", GB)], sizes, [2, 1], 0.9)
    with pytest.raises(UsageError, match="3 values for 2 ranks"):
        plan_split([RankRoom("a", GB), RankRoom("b", GB)], sizes, [2, 1, 1], 0.9)


def test_budgets_given_replace_the_planned_ones():
    sizes = uniform(4, 100 * MB, kv=1000)
    plan = place([RankRoom("a", GB), RankRoom("b", GB)], sizes, 0.9).with_budgets([5 * MB, MB])
    assert plan.budgets == [5 * MB, MB] and plan.budgets_given
    assert plan.rows[1].free_after == GB - 200 * MB - MB


def test_tensor_parallel_checks_memory_and_sets_budgets():
    sizes = uniform(4, 100 * MB, shared=50 * MB, kv=1000)
    plan = place_tensor([RankRoom("a", GB), RankRoom("b", GB)], sizes, 0.9)
    assert plan.split is None and plan.parallel == "tensor"
    assert [r.weights for r in plan.rows] == [250 * MB, 250 * MB]
    assert [r.kv_per_token for r in plan.rows] == [2000, 2000]
    assert plan.rows[0].layers is None and plan.rows[0].layers_text() == "all (a slice)"
    with pytest.raises(DoesNotFit, match="rank 1 on b"):
        place_tensor([RankRoom("a", GB), RankRoom("b", 200 * MB)], sizes, 0.9)


def test_the_plan_as_json():
    plan = place([RankRoom("a", GB), RankRoom("b", GB)], uniform(4, MB, kv=10), 0.9)
    doc = json.loads(json.dumps(plan.to_dict()))
    assert doc["split"] == [2, 2] and doc["source"] == "auto"
    assert [r["layers"] for r in doc["ranks"]] == [[2, 4], [0, 2]]
    assert {"host", "weights", "budget", "free_after", "memory"} <= set(doc["ranks"][0])


def test_the_memory_hook_names_hosts_so_a_replan_keeps_each_hosts(monkeypatch) -> None:
    from exokv.config import TEST_HOOKS

    monkeypatch.setenv("EXOKV_TEST_HOST_MEMORY", "mac-a=2GB,mac-b=1GB,mac-c=2GB")
    assert TEST_HOOKS.host_memory(["mac-a", "mac-b", "mac-c"]) == [2 * 10**9, 10**9, 2 * 10**9]
    assert TEST_HOOKS.host_memory(["mac-b", "mac-a"]) == [10**9, 2 * 10**9]
    monkeypatch.setenv("EXOKV_TEST_HOST_MEMORY", "mac-a=2GB")
    with pytest.raises(UsageError, match="HOST=SIZE"):
        TEST_HOOKS.host_memory(["mac-a", "mac-d"])


@pytest.mark.parametrize("width", [80, 60])
def test_the_plan_fits_the_terminal_without_cutting_words(
    width: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The caption once was one 180-column line, cut mid-word by an 80-column terminal."""
    import io

    from exokv.hosts.plan import plan_caption, show_plan

    monkeypatch.setenv("COLUMNS", str(width))  # rich's width for a file as for a terminal
    sizes = uniform(30, 100 * MB, shared=300 * MB, kv=10)
    plan = place([RankRoom("studio.local", 192 * GB), RankRoom("mini", 16 * GB)], sizes, 0.9)
    out = io.StringIO()
    show_plan(plan, out)
    text = out.getvalue()
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= width, text
    # Every word of the caption whole, in order, after the table.
    words = plan_caption(plan).split()
    assert " ".join(" ".join(lines).split()).endswith(" ".join(words)), text
