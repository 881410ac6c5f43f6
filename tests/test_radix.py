"""RadixTree: unit tests of split semantics and a stateful property test against a
naive reference (the set of every token prefix the tree holds)."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from exokv.cache.radix import Node, RadixTree

# Payloads are plain lists of the edge's tokens, so "the payload matches the key"
# checks that every split hands the right piece to each side.


def make_list_payload(tokens):
    return lambda start, end: list(tokens[start:end])


def split_list(payload, k):
    return payload[:k], payload[k:]


def insert(tree: RadixTree, tokens, session: str = ""):
    return tree.insert(tokens, make_list_payload(tokens), split_list, session=session)


def path_tokens(node: Node) -> tuple[int, ...]:
    keys = []
    while node.parent is not None:
        keys.append(node.key)
        node = node.parent
    return tuple(t for key in reversed(keys) for t in key)


def shape(tree: RadixTree) -> list[tuple]:
    return [
        (n.id, n.parent.id if n.parent else None, n.key, n.depth, tuple(n.payload))
        for n in tree.nodes()
    ]


# -- split semantics ------------------------------------------------------------------


def test_insert_into_empty_tree_makes_one_leaf():
    tree = RadixTree()
    added, split = insert(tree, [1, 2, 3, 4], session="a")
    assert split == []
    assert [(n.id, n.key, n.payload, n.session) for n in added] == [
        (1, (1, 2, 3, 4), [1, 2, 3, 4], "a")
    ]
    assert added[0].depth == 4 and added[0].start == 0 and added[0].is_leaf
    tree.check()


def test_divergent_insert_splits_upper_new_id_lower_keeps_id_and_tail():
    tree = RadixTree()
    (old,), _ = insert(tree, [1, 2, 3, 4], session="a")
    old.hits = 5
    old_last_used = old.last_used
    added, split = insert(tree, [1, 2, 9], session="b")
    tree.check()
    # insert reports the cut node (old id) as split and the new head as added.
    assert split == [old]
    upper, leaf = added
    # The upper part is a new node (fresh id) holding the head of the payload ...
    assert upper.id == 2 and upper.key == (1, 2) and upper.payload == [1, 2]
    assert upper.parent is tree.root and tree.root.children == {1: upper}
    assert upper.session == "a" and upper.hits == 5
    # ... the lower part is the old node object, old id, with the payload's tail.
    assert old.id == 1 and old.key == (3, 4) and old.payload == [3, 4]
    assert old.parent is upper and old.depth == 4 and old.start == 2
    assert old.last_used == old_last_used  # not used by this insert
    assert upper.last_used == leaf.last_used > old_last_used
    assert leaf.id == 3 and leaf.key == (9,) and leaf.payload == [9] and leaf.session == "b"
    assert upper.children == {3: old, 9: leaf}


def test_inserting_a_strict_prefix_splits_without_adding():
    tree = RadixTree()
    (old,), _ = insert(tree, [1, 2, 3, 4])
    added, split = insert(tree, [1, 2, 3])
    assert split == [old]
    (upper,) = added
    assert (upper.key, upper.payload, upper.depth) == ((1, 2, 3), [1, 2, 3], 3)
    assert (old.key, old.payload, old.parent) == ((4,), [4], upper)
    assert tree.match([1, 2, 3]).path == [upper]
    tree.check()


def test_inserting_an_existing_sequence_adds_nothing_and_touches_it():
    tree = RadixTree()
    (node,), _ = insert(tree, [1, 2, 3])
    before = node.last_used
    assert insert(tree, [1, 2, 3]) == ([], [])
    assert node.last_used > before
    assert shape(tree) == [(1, 0, (1, 2, 3), 3, (1, 2, 3))]


def test_direct_split_and_its_bounds():
    tree = RadixTree()
    (node,), _ = insert(tree, [5, 6, 7, 8, 9])
    upper = tree.split(node, 2, split_list)
    assert (upper.id, upper.key, upper.payload) == (2, (5, 6), [5, 6])
    assert (node.id, node.key, node.payload) == (1, (7, 8, 9), [7, 8, 9])
    tree.check()
    for k in (0, len(node.key)):
        with pytest.raises(AssertionError):
            tree.split(node, k, split_list)


def test_split_of_a_locked_node_keeps_its_tokens_protected():
    tree = RadixTree()
    insert(tree, [1, 2, 3, 4])
    hit = tree.match([1, 2, 3, 4])
    tree.lock(hit.path)
    added, split = insert(tree, [1, 2, 7])
    (lower,) = hit.path
    assert split == [lower] and lower.locks == 1
    upper = added[0]
    assert upper.key == (1, 2) and lower.parent is upper
    for node in (upper, lower):
        with pytest.raises(ValueError):
            tree.remove_leaf(node)
    tree.unlock(hit.path)
    tree.remove_leaf(lower)
    assert tree.match([1, 2, 3, 4]).length == 2
    tree.check()


def test_match_partial_edge_and_miss():
    tree = RadixTree()
    insert(tree, [1, 2, 3, 4])
    insert(tree, [1, 2, 5])
    m = tree.match([1, 2, 3, 9])
    assert m.length == 3 and [n.key for n in m.path] == [(1, 2), (3, 4)]
    assert m.last is m.path[-1]
    assert tree.match([7]).length == 0 and tree.match([7]).path == []
    assert tree.match([]).length == 0
    assert tree.match([1, 2, 5, 6]).length == 3


def test_remove_leaf_refuses_internal_locked_and_root_nodes():
    tree = RadixTree()
    insert(tree, [1, 2, 3])
    upper = insert(tree, [1, 2, 4])[0][0]
    assert upper.key == (1, 2)
    with pytest.raises(ValueError):
        tree.remove_leaf(upper)  # has children
    with pytest.raises(ValueError):
        tree.remove_leaf(tree.root)
    leaf = tree.match([1, 2, 3]).path[-1]
    tree.lock([leaf])
    with pytest.raises(ValueError):
        tree.remove_leaf(leaf)
    tree.unlock([leaf])
    with pytest.raises(ValueError):
        tree.unlock([leaf])
    tree.remove_leaf(leaf)
    tree.check()
    assert tree.match([1, 2, 3]).length == 2


def test_ids_are_never_reused_after_removal():
    tree = RadixTree()
    (a,), _ = insert(tree, [1])
    tree.remove_leaf(a)
    (b,), _ = insert(tree, [1])
    assert (a.id, b.id) == (1, 2)
    assert tree.find(2) is b and tree.find(1) is None


def test_check_catches_corruption():
    tree = RadixTree()
    (node,), _ = insert(tree, [1, 2])
    node.depth = 7
    with pytest.raises(AssertionError):
        tree.check()


# -- property test against a naive reference ---------------------------------------

TOKENS = st.integers(0, 3)
SEQS = st.lists(TOKENS, min_size=0, max_size=8)


class Edge(list):
    """A payload that can leave residence (as the disk tier's on-disk nodes do)."""

    cold = False


def is_warm(payload) -> bool:
    return not getattr(payload, "cold", False)


def split_edge(payload, k):
    head, tail = Edge(payload[:k]), Edge(payload[k:])
    head.cold = tail.cold = getattr(payload, "cold", False)
    return head, tail


def set_cold(tree: RadixTree, node: Node, cold: bool, in_place: bool) -> None:
    """Move a node in or out of residence, by a new payload or by changing it in place."""
    if in_place:
        if not isinstance(node.payload, Edge):
            node.payload = Edge(node.payload)
        node.payload.cold = cold
        tree.resize(node)
    else:
        edge = Edge(node.payload)
        edge.cold = cold
        node.payload = edge


def warm_path(tree: RadixTree, tokens) -> None:
    """What the disk tier does before an insert: the path's nodes come back, top down."""
    for node in tree.match(tokens).path:
        if not is_warm(node.payload):
            set_cold(tree, node, False, in_place=False)


class Reference:
    """Every token prefix the tree should hold; longest match by linear scan."""

    def __init__(self) -> None:
        self.prefixes: set[tuple[int, ...]] = set()

    def insert(self, tokens) -> None:
        self.prefixes |= {tuple(tokens[:k]) for k in range(1, len(tokens) + 1)}

    def remove_leaf(self, path: tuple[int, ...], start: int) -> None:
        # A leaf's edge is the only continuation of path[:start] that begins with
        # path[start], so every held prefix extending path[:start + 1] goes with it.
        head = path[: start + 1]
        self.prefixes = {p for p in self.prefixes if p[: start + 1] != head}

    def longest(self, tokens) -> int:
        best = 0
        for p in self.prefixes:
            if len(p) > best and tuple(tokens[: len(p)]) == p:
                best = len(p)
        return best


class RadixMachine(RuleBasedStateMachine):
    @initialize()
    def setup(self) -> None:
        # Payloads are token lists (weight = tokens held), some of them not resident.
        self.tree = RadixTree(size_of=len, resident=is_warm)
        self.ref = Reference()
        self.seen_ids: set[int] = set()
        self.held: list[tuple[list[Node], tuple[int, ...], int]] = []  # locks in use
        self.ops: list[tuple] = []  # replayed on a second tree: same ops, same tree

    def _record_new_ids(self, before: set[int]) -> set[int]:
        now = {n.id for n in self.tree.nodes()}
        new = now - before
        assert not new & self.seen_ids, f"ids reused: {new & self.seen_ids}"
        if self.seen_ids and new:
            assert min(new) > max(self.seen_ids), "ids come from an increasing counter"
        self.seen_ids |= new
        return new

    @rule(tokens=SEQS)
    def insert(self, tokens) -> None:
        warm_path(self.tree, tokens)
        before = {n.id for n in self.tree.nodes()}
        added, split = insert(self.tree, tokens)
        new = self._record_new_ids(before)
        # New nodes (heads of cut edges, the new leaf) are reported as added; cut
        # nodes keep their id (and the tail of their edge) and are reported as split.
        assert new == {n.id for n in added}
        assert all(n.id in before for n in split)
        assert len(split) == len(added) - sum(1 for n in added if n.is_leaf)
        assert not any(n.is_leaf for n in added[:-1])  # heads of cut edges come first
        if added and added[-1].is_leaf:
            assert added[-1].depth == len(tokens) and added[-1].key  # then the new leaf
        for node in split:
            assert node.parent in added and node.start == node.parent.depth
        self.ref.insert(tokens)
        self.ops.append(("insert", tuple(tokens)))

    @rule(tokens=SEQS)
    def lookup(self, tokens) -> None:
        m = self.tree.match(tokens)
        assert m.length == self.ref.longest(tokens)
        # The path spells the matched tokens: whole edges, then maybe part of one.
        spelled = [t for n in m.path for t in n.key]
        assert tuple(spelled[: m.length]) == tuple(tokens[: m.length])
        assert all(n.depth <= m.length for n in m.path[:-1])
        if m.path:
            assert m.path[-1].start < m.length <= m.path[-1].depth

    @rule(tokens=SEQS.filter(bool))
    def lock(self, tokens) -> None:
        m = self.tree.match(tokens)
        self.tree.lock(m.path)
        self.held.append((m.path, tuple(tokens), m.length))
        self.ops.append(("lock", tuple(tokens)))

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def unlock(self, data) -> None:
        i = data.draw(st.integers(0, len(self.held) - 1))
        path, tokens, _ = self.held.pop(i)
        self.tree.unlock(path)
        self.ops.append(("unlock", i))

    @rule(data=st.data())
    def evict(self, data) -> None:
        leaves = [n for n in self.tree.nodes() if n.is_leaf and not n.locks]
        if not leaves:
            return
        node = data.draw(st.sampled_from(leaves))
        path, start = path_tokens(node), node.start
        self.tree.remove_leaf(node)
        assert node.parent is None
        self.ref.remove_leaf(path, start)
        self.ops.append(("evict", node.id))

    @rule(tokens=SEQS)
    def touch(self, tokens) -> None:
        self.tree.touch(self.tree.match(tokens).path)
        self.ops.append(("touch", tuple(tokens)))

    @rule(data=st.data())
    def split(self, data) -> None:
        long = [n for n in self.tree.nodes() if len(n.key) > 1]
        if not long:
            return
        node = data.draw(st.sampled_from(long))
        k = data.draw(st.integers(1, len(node.key) - 1))
        before = {n.id for n in self.tree.nodes()}
        upper = self.tree.split(node, k, split_edge)
        assert self._record_new_ids(before) == {upper.id}
        self.ops.append(("split", node.id, k))

    @rule(data=st.data(), in_place=st.booleans())
    def spill(self, data, in_place) -> None:
        # A node leaves residence only when none of its children is resident.
        warm = [
            n
            for n in self.tree.nodes()
            if is_warm(n.payload) and not any(is_warm(c.payload) for c in n.children.values())
        ]
        if not warm:
            return
        node = data.draw(st.sampled_from(warm))
        set_cold(self.tree, node, True, in_place)
        self.ops.append(("cold", node.id, in_place))

    @rule(data=st.data(), in_place=st.booleans())
    def load(self, data, in_place) -> None:
        # A node comes back with every ancestor not resident yet, from the top down.
        cold = [n for n in self.tree.nodes() if not is_warm(n.payload)]
        if not cold:
            return
        node = data.draw(st.sampled_from(cold))
        path = []
        while node.parent is not None:
            path.append(node)
            node = node.parent
        for n in reversed(path):
            if not is_warm(n.payload):
                set_cold(self.tree, n, False, in_place)
                self.ops.append(("warm", n.id, in_place))

    @rule()
    def drain(self) -> None:
        changed = self.tree.drain_changed()
        assert all(n.parent is not None for n in changed), "a removed node is listed"
        assert len({n.id for n in changed}) == len(changed)
        assert self.tree.drain_changed() == []

    @rule(data=st.data())
    def removing_a_protected_node_fails(self, data) -> None:
        protected = [n for n in self.tree.nodes() if n.locks or not n.is_leaf]
        if not protected:
            return
        node = data.draw(st.sampled_from(protected))
        before = shape(self.tree)
        with pytest.raises(ValueError):
            self.tree.remove_leaf(node)
        assert shape(self.tree) == before

    @invariant()
    def integrity(self) -> None:
        self.tree.check()  # includes: every incremental figure equals a full recount
        for node in self.tree.nodes():  # the generator keeps the tier's invariant
            if not is_warm(node.payload):
                assert not any(is_warm(c.payload) for c in node.children.values())
        assert self.tree.weight == sum(len(n.key) for n in self.tree.nodes())
        for node_id in self.seen_ids:
            found = self.tree.find(node_id)
            assert found is None or (found.id == node_id and found.parent is not None)
        held = set()
        for node in self.tree.nodes():
            assert node.payload == list(node.key), "payload out of step with its edge"
            path = path_tokens(node)
            held |= {path[:k] for k in range(node.start + 1, node.depth + 1)}
            assert node.id in self.seen_ids
        assert held == self.ref.prefixes

    @invariant()
    def locked_tokens_stay_cached(self) -> None:
        for path, tokens, length in self.held:
            assert self.tree.match(tokens).length >= length
            assert all(n.parent is not None for n in path), "a locked node was removed"

    def teardown(self) -> None:
        if not hasattr(self, "tree"):
            return
        # Rank coherence: a second tree fed the same operations is identical, ids included.
        other, held = RadixTree(size_of=len, resident=is_warm), []
        for op, arg, *more in self.ops:
            if op == "insert":
                warm_path(other, arg)
                insert(other, list(arg))
            elif op == "lock":
                held.append(other.match(arg).path)
                other.lock(held[-1])
            elif op == "unlock":
                other.unlock(held.pop(arg))
            elif op == "touch":
                other.touch(other.match(arg).path)
            elif op == "split":
                other.split(other.find(arg), more[0], split_edge)
            elif op in ("cold", "warm"):
                set_cold(other, other.find(arg), op == "cold", more[0])
            else:
                other.remove_leaf(other.find(arg))
        assert shape(other) == shape(self.tree)
        assert [n.locks for n in other.nodes()] == [n.locks for n in self.tree.nodes()]
        assert [n.resident for n in other.nodes()] == [n.resident for n in self.tree.nodes()]
        assert other.figures() == self.tree.figures()
        # The digest tells trees apart: one more operation on one side changes it.
        leaf = next((n for n in other.nodes() if n.is_leaf and not n.locks), None)
        if leaf is not None:
            shapes = other.digest
            other.remove_leaf(leaf)
            assert other.digest != shapes


def test_radix_tree_matches_reference():
    run_state_machine_as_test(
        RadixMachine,
        settings=settings(
            max_examples=150,
            stateful_step_count=40,
            deadline=None,
            suppress_health_check=[HealthCheck.filter_too_much],
        ),
    )


# -- incremental figures ------------------------------------------------------------


def sized_tree() -> RadixTree:
    return RadixTree(size_of=lambda p: 0 if p is None else len(p))


def test_lru_leaves_follow_use_locks_and_evictions():
    tree = sized_tree()
    a = insert(tree, [1, 2, 3])[0][0]
    b = insert(tree, [1, 2, 4])[0][-1]  # splits a: upper (1, 2) with leaves a and b
    c = insert(tree, [5])[0][0]
    upper = a.parent
    assert [n.id for n in tree.lru_leaves()] == [a.id, b.id, c.id]  # a kept its old use
    tree.touch(tree.match([1, 2, 3]).path)
    assert list(tree.lru_leaves()) == [b, c, a]
    tree.lock([c])
    assert list(tree.lru_leaves()) == [b, a] and tree.evictable() == 2
    tree.unlock([c])
    assert list(tree.lru_leaves()) == [b, c, a]
    tree.remove_leaf(b)
    tree.remove_leaf(a)
    # The parent is a leaf again, with the last use it had.
    assert list(tree.lru_leaves()) == [c, upper] or list(tree.lru_leaves()) == [upper, c]
    assert [n.id for n in tree.lru_leaves()] == [
        n.id for n in sorted([c, upper], key=lambda n: (n.last_used, n.id))
    ]
    tree.check()


def test_resident_and_nonresident_orders_follow_spills_loads_and_locks():
    tree = RadixTree(size_of=len, resident=is_warm)
    a = insert(tree, [1, 2, 3])[0][0]
    b = insert(tree, [1, 2, 4])[0][-1]  # upper (1, 2) over a and b
    c = insert(tree, [5])[0][0]
    upper = a.parent
    assert list(tree.lru_leaves()) == [a, b, c] and list(tree.lru_nonresident()) == []
    set_cold(tree, a, True, in_place=True)  # a spilled: changed in place, the tree told
    assert list(tree.lru_leaves()) == [b, c] and list(tree.lru_nonresident()) == [a]
    set_cold(tree, b, True, in_place=False)  # b spilled: a new payload
    # upper's children are all off: upper is a resident leaf, with its own last use.
    assert list(tree.lru_leaves()) == sorted([upper, c], key=lambda n: (n.last_used, n.id))
    assert list(tree.lru_nonresident()) == [a, b]
    tree.lock([b])
    assert list(tree.lru_nonresident()) == [a]
    tree.unlock([b])
    set_cold(tree, upper, True, in_place=False)  # not a leaf: in neither order
    assert list(tree.lru_nonresident()) == [a, b] and list(tree.lru_leaves()) == [c]
    tree.remove_leaf(a)
    tree.remove_leaf(b)  # upper, childless now, is the next to leave the tree
    assert list(tree.lru_nonresident()) == [upper]
    warm_path(tree, [1, 2])  # loaded back
    assert list(tree.lru_leaves()) == sorted([upper, c], key=lambda n: (n.last_used, n.id))
    assert list(tree.lru_nonresident()) == []
    tree.check()


def test_weight_follows_payloads_set_from_outside():
    tree = sized_tree()
    (node,), _ = insert(tree, [1, 2, 3, 4])
    assert tree.weight == 4
    tree.drain_changed()
    node.payload = None  # e.g. a snapshot dropped, or one attached after the insert
    assert tree.weight == 0 and node.size == 0
    assert tree.drain_changed() == [node]  # its bytes are reported again
    node.payload = [9] * 10
    assert tree.weight == 10
    node.payload.append(9)  # changed in place: the tree is told
    tree.resize(node)
    assert tree.weight == 11
    tree.remove_leaf(node)
    assert tree.weight == 0
    node.payload = [1, 2]  # a removed node no longer counts
    assert tree.weight == 0 and len(tree) == 0


def test_split_keeps_the_weight_and_changes_the_digest():
    tree = sized_tree()
    (node,), _ = insert(tree, [1, 2, 3, 4])
    digest = tree.digest
    tree.split(node, 1, split_list)
    assert tree.weight == 4 and len(tree) == 2
    assert tree.digest != digest
    tree.check()


def test_digest_is_equal_for_the_same_operations_and_differs_otherwise():
    def build(seqs):
        tree = sized_tree()
        for s in seqs:
            insert(tree, s)
        return tree

    same = [build([[1, 2, 3], [1, 2, 4], [5, 6]]) for _ in range(2)]
    assert same[0].digest == same[1].digest
    # The same sequences in another order: other ids, another tree.
    assert build([[5, 6], [1, 2, 3], [1, 2, 4]]).digest != same[0].digest
    assert build([[1, 2, 3], [1, 2, 4], [5, 6, 7]]).digest != same[0].digest
    assert 0 <= same[0].digest < 1 << 62  # fits a signed 64-bit gather


def test_drain_changed_lists_what_a_turn_changed_and_no_more():
    tree = sized_tree()
    for s in ([1, 2, 3], [4, 5], [6, 7]):
        insert(tree, s)
    tree.drain_changed()
    path = tree.match([1, 2, 3]).path
    tree.touch(path)
    added, split = insert(tree, [1, 2, 9])
    leaf = tree.match([6, 7]).path[0]
    insert(tree, [6, 8])  # splits (6, 7), then the new leaf
    gone = tree.match([6, 8]).path[-1]
    tree.remove_leaf(gone)
    changed = tree.drain_changed()
    assert gone not in changed
    assert {n.id for n in changed} == {n.id for n in path + added + split} | {
        leaf.id,
        leaf.parent.id,
    }
    assert tree.drain_changed() == []


def test_find_and_clear():
    tree = sized_tree()
    nodes = [insert(tree, [i, i + 1])[0][0] for i in range(0, 10, 2)]
    assert all(tree.find(n.id) is n for n in nodes)
    assert tree.find(0) is None  # the root is no entry
    tree.clear()
    assert len(tree) == 0 and tree.weight == 0 and tree.digest == 0
    assert list(tree.lru_leaves()) == [] and tree.find(nodes[0].id) is None
    (again,), _ = insert(tree, [0, 1])
    assert again.id > nodes[-1].id
    tree.check()


@settings(max_examples=200, deadline=None)
@given(
    a=st.lists(st.integers(0, 3), max_size=300),
    b=st.lists(st.integers(0, 3), max_size=300),
    start=st.integers(0, 310),
    as_tuple=st.booleans(),
)
def test_common_prefix_equals_a_token_by_token_count(a, b, start, as_tuple):
    from exokv.cache.radix import common_prefix

    expected = 0
    while start + expected < len(b) and expected < len(a) and a[expected] == b[start + expected]:
        expected += 1
    assert common_prefix(tuple(a) if as_tuple else a, b, start) == expected
    long = a * 5
    assert common_prefix(long, long + [1]) == len(long)


# -- a turn touches what it changes, not the tree ----------------------------------------

VISITED: set[int] | None = None


class CountingNode(Node):
    __slots__ = ()

    def __getattribute__(self, name: str):
        if VISITED is not None:
            VISITED.add(object.__getattribute__(self, "id"))
        return object.__getattribute__(self, name)


def begin_turn(tree: RadixTree, prompt: list[int], over: int) -> tuple:
    """A turn's start on `tree`: its match touched and locked, the tree's figures then,
    and one rank whose budget is `over` below what the tree holds."""
    from exokv.cache.policy import RankLoad

    match = tree.match(prompt)
    tree.touch(match.path)
    tree.lock(match.path)
    figures = (len(tree), tree.digest, tree.weight)
    ranks = [RankLoad(cache_bytes=tree.weight, budget=tree.weight - over, pressure=0, ram=1)]
    return match, figures, ranks


class CountingTree(RadixTree):
    node_type = CountingNode


def test_a_turns_bookkeeping_visits_the_path_and_what_changed_not_the_tree():
    """10,000 nodes: 100 conversations of 100 turns. One more turn (match, touch, lock,
    the figures, 10 evictions from the LRU order, insert, unlock, the changed
    entries) reads a number of nodes bounded by its path and its evictions."""
    global VISITED
    from exokv.cache.policy import Entry, plan_lru

    rng = random.Random(0)
    tree = CountingTree(size_of=lambda p: 0 if p is None else len(p))
    convs = []
    for c in range(100):  # each conversation cut into its 100 turns of 5 tokens
        conv = [c * 1000 + 1] + [rng.randrange(50) for _ in range(499)]
        convs.append(conv)
        (node,), _ = insert(tree, conv)
        while len(node.key) > 5:
            node = tree.split(node, len(node.key) - 5, split_list)
    assert len(tree) == 10_000
    tree.drain_changed()

    def entry(node):
        parent = node.parent.id if node.parent is not None else None
        return Entry(node.id, parent, node.last_used, node.locks > 0)

    prompt = convs[7] + [1, 2, 3]
    VISITED = set()
    try:
        match, figures, ranks = begin_turn(tree, prompt, over=50)
        evictions = plan_lru(
            (entry(n) for n in tree.lru_leaves()),
            entry=lambda i: entry(tree.find(i)) if tree.find(i) else None,
            children=lambda i: len(tree.find(i).children),
            sizes_of=lambda i: [tree.find(i).size],
            ranks=ranks,
            threshold=1.0,
        )
        for e in evictions:
            tree.remove_leaf(tree.find(e.entry))
        insert(tree, prompt + [4, 5])
        tree.unlock(match.path)
        changed = tree.drain_changed()
        visited = len(VISITED)
    finally:
        VISITED = None
    assert figures[0] == 10_000 and len(evictions) == 10
    path = len(match.path)
    assert path == 100
    assert len(changed) <= path + 2
    # Each eviction reads its leaf and its parent; the path is read by match, touch,
    # lock, insert and unlock. Nothing else: 10,000 nodes, about 125 read.
    assert visited <= path + 2 * len(evictions) + 5, visited
    tree.check()
    # And the counting sees a full walk for what it is.
    VISITED = set()
    try:
        tree.recount()
        assert len(VISITED) >= len(tree)
    finally:
        VISITED = None
