"""RadixTree: unit tests of split semantics and a stateful property test against a
naive reference (the set of every token prefix the tree holds)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
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
        self.tree = RadixTree()
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
        self.tree.check()
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
        other, held = RadixTree(), []
        for op, arg in self.ops:
            if op == "insert":
                insert(other, list(arg))
            elif op == "lock":
                held.append(other.match(arg).path)
                other.lock(held[-1])
            elif op == "unlock":
                other.unlock(held.pop(arg))
            else:
                other.remove_leaf(other.find(arg))
        assert shape(other) == shape(self.tree)
        assert [n.locks for n in other.nodes()] == [n.locks for n in self.tree.nodes()]


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
