"""The eviction plan: a pure function of numbers every rank holds identically."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from exokv.cache.policy import Entry, Eviction, RankLoad, plan, plan_lru
from exokv.cache.radix import RadixTree

MB = 1 << 20
GB = 1 << 30


def load(cache_bytes, budget=None, pressure=0.0, ram=16 * GB, headroom=0) -> RankLoad:
    return RankLoad(
        cache_bytes=cache_bytes, budget=budget, pressure=pressure, ram=ram, headroom=headroom
    )


def one_rank(entries, sizes, threshold=0.9, **kw):
    """Plan for a single rank whose cache holds exactly the listed entries."""
    return plan(entries, [sizes], [load(sum(sizes), **kw)], threshold)


def ids(evictions):
    return [e.entry for e in evictions]


def flat(last_used):
    """Root-level leaves (parent None) with the given last_used values, ids 1.."""
    return [Entry(id=i + 1, parent=None, last_used=t) for i, t in enumerate(last_used)]


def test_nothing_to_do_under_budget_and_threshold():
    entries = flat([1, 2, 3])
    assert one_rank(entries, [10, 10, 10], budget=30) == []
    assert one_rank(entries, [10, 10, 10]) == []  # no budget, no pressure


def test_lru_order_and_stops_once_under_budget():
    entries = flat([30, 10, 20, 40])  # LRU order: 2, 3, 1, 4
    assert ids(one_rank(entries, [10] * 4, budget=40)) == []
    assert ids(one_rank(entries, [10] * 4, budget=39)) == [2]
    assert ids(one_rank(entries, [10] * 4, budget=20)) == [2, 3]
    assert ids(one_rank(entries, [10] * 4, budget=0)) == [2, 3, 1, 4]


def test_reason_names_the_budget_rank():
    out = one_rank(flat([1]), [10], budget=5)
    assert out == [Eviction(entry=1, reason="budget rank 0")]


def test_locked_entries_are_never_evicted():
    entries = [
        Entry(1, None, last_used=1, locked=True),
        Entry(2, None, last_used=2),
        Entry(3, None, last_used=3, locked=True),
    ]
    # Even with a budget of zero, only the unlocked one goes; then it gives up.
    assert ids(one_rank(entries, [10, 10, 10], budget=0)) == [2]


def test_parent_becomes_evictable_only_after_its_children():
    # 1 is the oldest but has children 2 and 3; 3 has child 4.
    entries = [
        Entry(1, None, last_used=1),
        Entry(2, 1, last_used=5),
        Entry(3, 1, last_used=2),
        Entry(4, 3, last_used=6),
        Entry(5, None, last_used=4),
    ]
    out = ids(one_rank(entries, [1] * 5, budget=0))
    assert out == [5, 2, 4, 3, 1]
    for parent, child in [(1, 2), (1, 3), (3, 4)]:
        assert out.index(child) < out.index(parent)


def test_locked_child_pins_its_ancestors():
    entries = [Entry(1, None, 1), Entry(2, 1, 2), Entry(3, 2, 3, locked=True), Entry(4, 1, 4)]
    assert ids(one_rank(entries, [1] * 4, budget=0)) == [4]


def test_entries_whose_parent_is_the_unlisted_root_count_as_roots():
    entries = [Entry(1, 0, last_used=2), Entry(2, 0, last_used=1)]  # 0: the tree's root
    assert ids(one_rank(entries, [1, 1], budget=0)) == [2, 1]


def test_headroom_counts_against_the_budget():
    entries = flat([1, 2, 3])
    sizes = [10, 10, 10]
    assert ids(one_rank(entries, sizes, budget=35)) == []
    assert ids(one_rank(entries, sizes, budget=35, headroom=5)) == []  # 35 <= 35
    assert ids(one_rank(entries, sizes, budget=35, headroom=6)) == [1]
    assert ids(one_rank(entries, sizes, budget=35, headroom=25)) == [1, 2]
    assert ids(one_rank(entries, sizes, budget=35, headroom=26)) == [1, 2, 3]
    # Headroom that no eviction can make room for: evict all that is evictable, then stop.
    assert ids(one_rank(entries, sizes, budget=35, headroom=100)) == [1, 2, 3]


def test_per_rank_budgets_evict_until_every_rank_fits():
    entries = flat([1, 2, 3, 4])
    sizes = [[10, 10, 10, 10], [5, 30, 5, 5]]  # rank 1 holds entry 2 big (uneven sharding)
    ranks = [load(40, budget=100), load(45, budget=20)]
    out = plan(entries, sizes, ranks, threshold=0.9)
    # Evicting 1 leaves rank 1 at 40 > 20; evicting 2 brings it to 10.
    assert out == [Eviction(1, "budget rank 1"), Eviction(2, "budget rank 1")]


def test_reason_names_the_worst_rank():
    entries = flat([1, 2, 3])
    sizes = [[1, 10, 10], [10, 1, 1]]
    # Rank 0 is 40% over its budget, rank 1 140% over: the reason names rank 1.
    # Evicting entry 1 fixes rank 1 but leaves rank 0 over: the reason moves to rank 0.
    ranks = [load(21, budget=15), load(12, budget=5)]
    out = plan(entries, sizes, ranks, threshold=0.9)
    assert out == [Eviction(1, "budget rank 1"), Eviction(2, "budget rank 0")]


def test_pressure_threshold_with_freed_bytes_relief():
    entries = flat([1, 2, 3, 4])
    ram = 1000 * MB
    sizes = [[50 * MB] * 4]
    # Pressure 0.97 over a 0.9 threshold: each freed 50MB relieves 0.05 of pressure,
    # so two evictions bring it to 0.87.
    out = plan(entries, sizes, [load(200 * MB, pressure=0.97, ram=ram)], threshold=0.9)
    assert out == [Eviction(1, "pressure rank 0"), Eviction(2, "pressure rank 0")]
    out = plan(entries, sizes, [load(200 * MB, pressure=0.93, ram=ram)], threshold=0.9)
    assert ids(out) == [1]
    assert plan(entries, sizes, [load(200 * MB, pressure=0.9, ram=ram)], threshold=0.9) == []
    # Pressure the cache cannot relieve: everything evictable goes, then it stops.
    out = plan(entries, sizes, [load(200 * MB, pressure=0.99 + 0.2, ram=ram)], threshold=0.9)
    assert ids(out) == [1, 2, 3, 4]


def test_pressure_on_one_rank_evicts_for_all():
    entries = flat([1, 2])
    sizes = [[MB, MB], [100 * MB, 100 * MB]]
    ranks = [load(2 * MB, pressure=0.1, ram=GB), load(200 * MB, pressure=0.95, ram=GB)]
    assert plan(entries, sizes, ranks, threshold=0.9) == [Eviction(1, "pressure rank 1")]


def test_deterministic_tie_break_by_id():
    entries = [Entry(7, None, 5), Entry(3, None, 5), Entry(5, None, 5)]
    assert ids(one_rank(entries, [1, 1, 1], budget=1)) == [3, 5]


def test_sizes_must_have_one_row_per_rank():
    with pytest.raises(ValueError):
        plan(flat([1]), [[1], [1]], [load(1, budget=0)], threshold=0.9)


def test_gathered_numbers_evict_where_local_numbers_alone_would_not():
    """THE divergence the design prevents (exo #1341).

    Rank 0 has a big budget and is comfortably under it; rank 1 (a smaller
    machine) holds the same entries but is over its budget. A plan from the
    gathered numbers evicts on every rank for rank 1; a plan rank 0 computed
    from its own numbers alone would keep everything, and the two ranks' caches
    (and so their next prefill) would disagree.
    """
    entries = flat([3, 1, 2])
    sizes = [[2 * MB, 2 * MB, 2 * MB], [900_000, 900_000, 900_000]]
    rank0 = load(6 * MB, budget=8 * MB)  # 6MB of 8MB: fine
    rank1 = load(2_700_000, budget=2 * MB)  # 2.7MB of 2MB: over
    gathered = plan(entries, sizes, [rank0, rank1], threshold=0.9)
    assert gathered == [Eviction(entry=2, reason="budget rank 1")]
    assert plan(entries, sizes[:1], [rank0], threshold=0.9) == []
    # And every rank computing from the gathered numbers computes the same plan.
    assert plan(entries, sizes, [rank0, rank1], threshold=0.9) == gathered


# -- determinism --------------------------------------------------------------------


@st.composite
def scenarios(draw):
    n = draw(st.integers(0, 12))
    entries = []
    for i in range(n):
        parent = draw(st.sampled_from([None, *range(1, i + 1)]))  # parents come first
        entries.append(
            Entry(
                id=i + 1,
                parent=parent,
                last_used=draw(st.integers(0, 4)),  # few values: many ties
                locked=draw(st.booleans()),
            )
        )
    nranks = draw(st.integers(1, 3))
    sizes = [[draw(st.integers(0, 100)) for _ in range(n)] for _ in range(nranks)]
    ranks = [
        RankLoad(
            cache_bytes=sum(row),
            budget=draw(st.one_of(st.none(), st.integers(0, 600))),
            pressure=draw(st.floats(0, 1.2)),
            ram=draw(st.integers(1, 2000)),
            headroom=draw(st.integers(0, 100)),
        )
        for row in sizes
    ]
    order = draw(st.permutations(range(n)))
    return entries, sizes, ranks, draw(st.floats(0.5, 1.0)), order


@settings(max_examples=300, deadline=None)
@given(scenarios())
def test_plan_is_a_function_of_its_inputs_not_their_order(scenario):
    entries, sizes, ranks, threshold, order = scenario
    out = plan(entries, sizes, ranks, threshold)
    shuffled = plan(
        [entries[i] for i in order], [[row[i] for i in order] for row in sizes], ranks, threshold
    )
    assert shuffled == out  # same evictions, same order, same reasons
    # And what it plans is admissible: unlocked, each a leaf when it goes, no repeats.
    by_id = {e.id: e for e in entries}
    gone: set[int] = set()
    for ev in out:
        assert not by_id[ev.entry].locked and ev.entry not in gone
        assert all(e.parent != ev.entry or e.id in gone for e in entries)
        gone.add(ev.entry)


# -- plan_lru: the same plan, O(evictions x log) ---------------------------------------


def naive_plan(entries, sizes, ranks, threshold):
    """The former plan(): every step scans every entry for the LRU unlocked leaf."""
    from exokv.cache.policy import _worst_rank

    index = {e.id: i for i, e in enumerate(entries)}
    children = {e.id: 0 for e in entries}
    for e in entries:
        if e.parent in children:
            children[e.parent] += 1
    held = [r.cache_bytes for r in ranks]
    freed = [0] * len(ranks)
    alive = set(index)
    out = []
    while True:
        reason = _worst_rank(ranks, held, freed, threshold)
        if reason is None:
            return out
        leaves = [entries[index[i]] for i in alive if children[i] == 0]
        leaves = [e for e in leaves if not e.locked]
        if not leaves:
            return out
        victim = min(leaves, key=lambda e: (e.last_used, e.id))
        alive.remove(victim.id)
        if victim.parent in children:
            children[victim.parent] -= 1
        for r in range(len(ranks)):
            held[r] -= sizes[r][index[victim.id]]
            freed[r] += sizes[r][index[victim.id]]
        out.append(Eviction(entry=victim.id, reason=reason))


@settings(max_examples=300, deadline=None)
@given(scenarios())
def test_plan_equals_the_former_full_scan(scenario):
    entries, sizes, ranks, threshold, _ = scenario
    assert plan(entries, sizes, ranks, threshold) == naive_plan(entries, sizes, ranks, threshold)


def _touch_and_lock(tree: RadixTree, seqs, touches, locks) -> None:
    """Use the listed conversations (LRU order) and lock others' paths (a turn in flight)."""
    for i in touches:
        if i < len(seqs):
            tree.touch(tree.match(seqs[i]).path)
    for i in locks:
        if i < len(seqs):
            tree.lock(tree.match(seqs[i]).path)


@settings(max_examples=150, deadline=None)
@given(
    seqs=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=6), max_size=12),
    touches=st.lists(st.integers(0, 11), max_size=6),
    locks=st.lists(st.integers(0, 11), max_size=3),
    budget=st.integers(0, 40),
)
def test_plan_lru_over_a_tree_equals_plan_over_its_entry_list(seqs, touches, locks, budget):
    tree = RadixTree(size_of=len)
    for s in seqs:
        tree.insert(s, lambda a, b, s=s: list(s[a:b]), lambda p, k: (p[:k], p[k:]))
    _touch_and_lock(tree, seqs, touches, locks)
    nodes = list(tree.nodes())
    entries = [Entry(n.id, n.parent.id, n.last_used, n.locks > 0) for n in nodes]
    sizes = [[n.size for n in nodes], [2 * n.size for n in nodes]]
    ranks = [load(tree.weight, budget=budget), load(2 * tree.weight, budget=2 * budget + 5)]
    expected = plan(entries, sizes, ranks, threshold=0.9)

    def entry(i):
        n = tree.find(i)
        return None if n is None else Entry(n.id, n.parent.id, n.last_used, n.locks > 0)

    taken = []

    def leaves():
        for n in tree.lru_leaves():
            taken.append(n.id)
            yield entry(n.id)

    got = plan_lru(
        leaves(),
        entry=entry,
        children=lambda i: len(tree.find(i).children),
        sizes_of=lambda i: [tree.find(i).size, 2 * tree.find(i).size],
        ranks=ranks,
        threshold=0.9,
    )
    assert got == expected
    # Lazy: it takes no more leaves from the tree than it evicts, plus one.
    assert len(taken) <= len(got) + 1


def test_plan_lru_wants_one_size_per_rank():
    with pytest.raises(ValueError):
        plan_lru(
            flat([1]),
            entry=lambda i: None,
            children=lambda i: 0,
            sizes_of=lambda i: [1, 1],
            ranks=[load(1, budget=0)],
            threshold=0.9,
        )


class Part(list):
    """A payload of token ids that may be on disk (not resident)."""

    on_disk = False


def in_ram(payload) -> bool:
    return not getattr(payload, "on_disk", False)


def ram_only_plan(tree: RadixTree, sizes_of, loads, threshold, pinned) -> list[Eviction]:
    """What the coordinator planned with a disk tier before the tree kept a RAM-leaf
    order: `plan` over a list of every RAM node (a full walk)."""
    nodes = [n for n in tree.nodes() if in_ram(n.payload)]
    rows = [sizes_of(n) for n in nodes]
    sizes = [[row[r] for row in rows] for r in range(len(loads))]
    entries = [Entry(n.id, n.parent.id, n.last_used, n.locks > 0 or n in pinned) for n in nodes]
    return plan(entries, sizes, loads, threshold)


@settings(max_examples=300, deadline=None)
@given(
    seqs=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=6), max_size=12),
    spills=st.lists(st.integers(0, 50), max_size=10),
    touches=st.lists(st.integers(0, 11), max_size=6),
    locks=st.lists(st.integers(0, 11), max_size=3),
    pins=st.lists(st.integers(0, 60), max_size=4),
    budget=st.integers(0, 40),
)
def test_plan_over_the_ram_leaf_order_equals_the_ram_only_full_walk(
    seqs, spills, touches, locks, pins, budget
):
    from exokv.cache.coordinate import plan_tree

    tree = RadixTree(size_of=len, resident=in_ram)
    for s in seqs:
        tree.insert(s, lambda a, b, s=s: Part(s[a:b]), lambda p, k: (Part(p[:k]), Part(p[k:])))
    for i in spills:  # spill a RAM leaf (a RAM node with no child in RAM), as the tier does
        leaves = [
            n
            for n in tree.nodes()
            if in_ram(n.payload) and not any(in_ram(c.payload) for c in n.children.values())
        ]
        if leaves:
            node = leaves[i % len(leaves)]
            moved = Part(node.payload)
            moved.on_disk = True
            node.payload = moved
    _touch_and_lock(tree, seqs, touches, locks)
    pinned = {n for n in tree.nodes() if n.id in pins}
    ram = sum(len(n.payload) for n in tree.nodes() if in_ram(n.payload))
    loads = [load(ram, budget=budget), load(2 * ram + 1, budget=2 * budget + 5)]

    def sizes_of(node):
        return [len(node.payload), 2 * len(node.payload) + 1]

    expected = ram_only_plan(tree, sizes_of, loads, 0.9, pinned)
    taken = []
    order = tree.lru_leaves

    def counted():
        for n in order():
            taken.append(n.id)
            yield n

    tree.lru_leaves = counted
    got = plan_tree(tree, sizes_of, loads, 0.9, pinned)
    assert got == expected
    # Lazy: no more of the RAM-leaf order is read than is evicted, plus one (and pins).
    assert len(taken) <= len(got) + 1 + len(pinned)


def test_pinned_entries_go_after_every_unpinned_one():
    # 1 and 3 are pinned and the oldest: every unpinned entry goes first, then they do.
    entries = [
        Entry(1, None, last_used=1, pinned=True),
        Entry(2, None, last_used=5),
        Entry(3, None, last_used=2, pinned=True),
        Entry(4, None, last_used=3),
    ]
    assert ids(one_rank(entries, [10] * 4, budget=25)) == [4, 2]
    assert ids(one_rank(entries, [10] * 4, budget=0)) == [4, 2, 1, 3]


def test_a_pinned_parent_exposed_by_the_plan_waits_for_the_unpinned_leaves():
    # 1 (pinned) loses its only child 2 (pinned) and becomes a leaf: still after 3 and 4.
    entries = [
        Entry(1, None, last_used=1, pinned=True),
        Entry(2, 1, last_used=2, pinned=True),
        Entry(3, None, last_used=8),
        Entry(4, None, last_used=9),
    ]
    assert ids(one_rank(entries, [10] * 4, budget=0)) == [3, 4, 2, 1]
    # An unpinned parent exposed by evicting its child goes in LRU order among the unpinned.
    entries = [Entry(1, None, 1), Entry(2, 1, 2), Entry(3, None, 9, pinned=True)]
    assert ids(one_rank(entries, [10] * 3, budget=0)) == [2, 1, 3]
