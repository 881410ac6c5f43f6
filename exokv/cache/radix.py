"""A token radix tree: which token sequences are cached, and in which pieces.

Knows nothing of MLX. Each node owns one edge of tokens and an opaque payload
(the K/V slices of exactly those tokens, supplied by the prefix cache), so a
prefix shared by many conversations is held once. Node ids come from a counter,
so every rank that performs the same operations in the same order builds the
same tree with the same ids — the basis of rank-coherent decisions.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(eq=False)
class Node:
    id: int
    parent: Node | None
    key: tuple[int, ...]
    depth: int  # tokens from the root to the end of this edge
    payload: Any = None
    children: dict[int, Node] = field(default_factory=dict)
    locks: int = 0
    last_used: int = 0
    hits: int = 0
    session: str = ""

    @property
    def start(self) -> int:
        return self.depth - len(self.key)

    @property
    def is_leaf(self) -> bool:
        return not self.children


@dataclass
class Match:
    """The longest cached prefix: the nodes on its path, the last possibly partial."""

    path: list[Node]
    length: int

    @property
    def last(self) -> Node | None:
        return self.path[-1] if self.path else None


# split_payload(payload, k) -> (payload of the first k tokens, payload of the rest)
SplitPayload = Callable[[Any, int], tuple[Any, Any]]


class RadixTree:
    def __init__(self) -> None:
        self.root = Node(id=0, parent=None, key=(), depth=0)
        self._next_id = 1
        self.clock = 0

    def tick(self) -> int:
        self.clock += 1
        return self.clock

    def nodes(self) -> Iterator[Node]:
        """Every node but the root, parents before children, in id order among siblings."""
        stack = [self.root]
        while stack:
            node = stack.pop()
            if node is not self.root:
                yield node
            stack.extend(sorted(node.children.values(), key=lambda n: -n.id))

    def match(self, tokens: Sequence[int]) -> Match:
        node, pos, path = self.root, 0, []
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                break
            common = common_prefix(child.key, tokens, pos)
            path.append(child)
            pos += common
            if common < len(child.key):
                break
            node = child
        return Match(path=path, length=pos)

    def insert(
        self,
        tokens: Sequence[int],
        make_payload: Callable[[int, int], Any],
        split_payload: SplitPayload,
        session: str = "",
    ) -> tuple[list[Node], list[Node]]:
        """Make `tokens` a path of the tree. Returns (new nodes, nodes whose edge was cut).

        A cut node keeps its id and the tail of its edge; the head becomes a new node.

        make_payload(start, end) builds the payload for tokens[start:end].
        """
        added: list[Node] = []
        split: list[Node] = []
        node, pos = self.root, 0
        now = self.tick()
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                leaf = self._new_node(node, tuple(tokens[pos:]), make_payload(pos, len(tokens)))
                leaf.session = session
                leaf.last_used = now
                added.append(leaf)
                return added, split
            common = common_prefix(child.key, tokens, pos)
            if common < len(child.key):
                split.append(child)
                child = self.split(child, common, split_payload)
                added.append(child)
            child.last_used = now
            node, pos = child, pos + common
        return added, split

    def split(self, node: Node, k: int, split_payload: SplitPayload) -> Node:
        """Cut node's edge after k tokens; returns the new upper node (the old id stays below)."""
        assert 0 < k < len(node.key)
        parent = node.parent
        assert parent is not None
        head, tail = split_payload(node.payload, k)
        upper = self._new_node(parent, node.key[:k], head)
        upper.session, upper.last_used, upper.hits = node.session, node.last_used, node.hits
        del parent.children[node.key[0]]
        parent.children[upper.key[0]] = upper
        node.key = node.key[k:]
        node.payload = tail
        node.parent = upper
        upper.children[node.key[0]] = node
        return upper

    def remove_leaf(self, node: Node) -> None:
        if node.children or node.locks or node is self.root:
            raise ValueError(f"node {node.id} is not an unlocked leaf")
        assert node.parent is not None
        del node.parent.children[node.key[0]]
        node.parent = None

    def lock(self, path: Sequence[Node]) -> None:
        for node in path:
            node.locks += 1

    def unlock(self, path: Sequence[Node]) -> None:
        for node in path:
            if node.locks <= 0:
                raise ValueError(f"node {node.id} is not locked")
            node.locks -= 1

    def touch(self, path: Sequence[Node]) -> None:
        now = self.tick()
        for node in path:
            node.last_used = now

    def find(self, node_id: int) -> Node | None:
        return next((n for n in self.nodes() if n.id == node_id), None)

    def check(self) -> None:
        """Raise AssertionError if the tree's invariants do not hold."""
        seen: set[int] = set()
        for node in self.nodes():
            assert node.id not in seen, f"duplicate id {node.id}"
            seen.add(node.id)
            assert node.key, f"node {node.id} has an empty edge"
            assert node.parent is not None
            assert node.parent.children.get(node.key[0]) is node, f"node {node.id} is detached"
            assert node.depth == node.parent.depth + len(node.key), f"node {node.id} depth"
            assert node.locks >= 0
            for first, child in node.children.items():
                assert child.key[0] == first

    def _new_node(self, parent: Node, key: tuple[int, ...], payload: Any) -> Node:
        node = Node(
            id=self._next_id,
            parent=parent,
            key=key,
            depth=parent.depth + len(key),
            payload=payload,
        )
        self._next_id += 1
        parent.children[key[0]] = node
        return node


def common_prefix(a: Sequence[int], b: Sequence[int], start: int = 0) -> int:
    """How many tokens of `a` equal `b` from position `start` of `b` on."""
    n = min(len(a), len(b) - start)
    i = 0
    while i < n and a[i] == b[start + i]:
        i += 1
    return i
