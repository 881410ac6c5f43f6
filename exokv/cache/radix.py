"""A token radix tree: which token sequences are cached, and in which pieces.

Knows nothing of MLX. Each node owns one edge of tokens and an opaque payload
(the K/V slices of exactly those tokens, supplied by the prefix cache), so a
prefix shared by many conversations is held once. Node ids come from a counter,
so every rank that performs the same operations in the same order builds the
same tree with the same ids — the basis of rank-coherent decisions.

The tree keeps its own figures up to date as it changes, so that a turn's
bookkeeping costs what the turn changed, never a walk of the whole tree:
`len(tree)`, `tree.digest` (its shape, comparable across ranks), `tree.weight`
(the sum of the payloads' sizes), `tree.lru_leaves()` (the evictable leaves,
least recently used first), `tree.find(id)` and `tree.drain_changed()`.
`recount()` and `check()` compute the same figures the slow way, from scratch.

A payload can be resident or not (a predicate the tree is given; by default every
payload is). The owner keeps the non-resident nodes a lower part of the tree (a
node is non-resident only if its children are too), and the tree keeps two orders:
`lru_leaves()`, the resident nodes none of whose children are resident (what can
leave residence next), and `lru_nonresident()`, the non-resident nodes with no
children at all (what can leave the tree next). With every payload resident the
first is simply the leaves.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from sortedcontainers import SortedList

_MASK64 = (1 << 64) - 1
_DIGEST_BITS = (1 << 62) - 1  # fits a signed 64-bit gather with room to spare
_SCAN = 32  # below this many tokens a plain loop beats more slicing


class Node:
    """One edge of the tree. Assigning `payload` keeps the tree's `weight` right."""

    __slots__ = (
        "id",
        "parent",
        "key",
        "depth",
        "_payload",
        "size",
        "children",
        "locks",
        "last_used",
        "hits",
        "session",
        "_tree",
        "_lru",
        "_cold",
        "resident",
        "resident_children",
    )

    def __init__(
        self,
        id: int,
        parent: Node | None,
        key: tuple[int, ...],
        depth: int,
        payload: Any = None,
    ) -> None:
        self.id = id
        self.parent = parent
        self.key = key
        self.depth = depth  # tokens from the root to the end of this edge
        self._payload = payload
        self.size = 0  # the tree's size_of(payload), counted in tree.weight while attached
        self.children: dict[int, Node] = {}
        self.locks = 0
        self.last_used = 0
        self.hits = 0
        self.session = ""
        self._tree: RadixTree | None = None  # set while the node is part of a tree
        self._lru: tuple[int, int] | None = None  # its key in the tree's evictable set
        self._cold: tuple[int, int] | None = None  # its key in the non-resident leaf set
        self.resident = True  # the tree's predicate on the payload, as last evaluated
        self.resident_children = 0  # children whose payload is resident

    @property
    def payload(self) -> Any:
        return self._payload

    @payload.setter
    def payload(self, value: Any) -> None:
        self._payload = value
        if self._tree is not None:
            self._tree.resize(self)

    @property
    def start(self) -> int:
        return self.depth - len(self.key)

    @property
    def is_leaf(self) -> bool:
        return not self.children

    def __repr__(self) -> str:
        parent = self.parent.id if self.parent is not None else None
        return f"Node(id={self.id}, parent={parent}, depth={self.depth}, tokens={len(self.key)})"


@dataclass
class Match:
    """The longest cached prefix: the nodes on its path, the last possibly partial."""

    path: list[Node]
    length: int

    @property
    def last(self) -> Node | None:
        return self.path[-1] if self.path else None


@dataclass(frozen=True)
class Figures:
    """What the tree keeps incrementally, as a full walk computes it."""

    count: int
    digest: int
    weight: int
    lru: list[tuple[int, int]]  # (last_used, id) of every unlocked resident leaf, in order
    nonresident: list[tuple[int, int]]  # the same of every unlocked non-resident leaf


# split_payload(payload, k) -> (payload of the first k tokens, payload of the rest)
SplitPayload = Callable[[Any, int], tuple[Any, Any]]
SizeOf = Callable[[Any], int]
Key = tuple[int, int]  # (last_used, id): a node's place in an LRU order
COLD_OFFSET = 1 << 48  # put_first's times: below every clock value a tree reaches
Resident = Callable[[Any], bool]


def _no_size(payload: Any) -> int:
    return 0


def _always(payload: Any) -> bool:
    return True


class RadixTree:
    node_type: type[Node] = Node  # the class of new nodes (tests count reads with a subclass)

    def __init__(self, size_of: SizeOf | None = None, resident: Resident | None = None) -> None:
        """size_of(payload) is the number `weight` sums (e.g. bytes); 0 for every node if None.
        resident(payload) says whether a payload is resident (e.g. in RAM); True if None."""
        self._size_of = size_of or _no_size
        self._resident = resident or _always
        self.root = self.node_type(id=0, parent=None, key=(), depth=0)
        self._next_id = 1
        self.clock = 0
        self._index: dict[int, Node] = {}
        self._digest = 0
        self.weight = 0
        self._lru: SortedList = SortedList()
        self._cold: SortedList = SortedList()
        self._changed: dict[int, Node] = {}

    def tick(self) -> int:
        self.clock += 1
        return self.clock

    # -- figures kept as the tree changes --------------------------------------

    def __len__(self) -> int:
        """Nodes in the tree, the root not counted."""
        return len(self._index)

    @property
    def digest(self) -> int:
        """The tree's shape (ids, depths, parents): equal on ranks that did the same
        operations, different (but for a 2**-62 chance) when they did not."""
        return self._digest & _DIGEST_BITS

    def lru_leaves(self) -> Iterator[Node]:
        """Unlocked resident nodes with no resident child (with every payload resident:
        the unlocked leaves), least recently used first (ties: lower id first). Lazy:
        taking the first k costs O(k + log n). Do not change the tree while iterating."""
        index = self._index
        for _, node_id in self._lru:
            yield index[node_id]

    def lru_nonresident(self) -> Iterator[Node]:
        """Unlocked non-resident nodes with no children, least recently used first; lazy
        like `lru_leaves`."""
        index = self._index
        for _, node_id in self._cold:
            yield index[node_id]

    def evictable(self) -> int:
        """How many nodes `lru_leaves` lists."""
        return len(self._lru)

    def find(self, node_id: int) -> Node | None:
        return self._index.get(node_id)

    def drain_changed(self) -> list[Node]:
        """Nodes added or changed (edge, parent, last_used, size) since the last call and
        still in the tree, in the order they first changed. Removed nodes are not listed."""
        changed = list(self._changed.values())
        self._changed.clear()
        return changed

    def resize(self, node: Node) -> None:
        """Count `node`'s payload again, its size and whether it is resident: call it
        after changing a payload in place."""
        if node._tree is not self:
            return
        size = self._size_of(node._payload)
        if size != node.size:
            self.weight += size - node.size
            node.size = size
            self._changed[node.id] = node  # its bytes are reported
        resident = bool(self._resident(node._payload))
        if resident != node.resident:
            node.resident = resident
            parent = node.parent
            assert parent is not None
            parent.resident_children += 1 if resident else -1
            self._changed[node.id] = node  # where it is is reported
            self._refresh(node)
            self._refresh(parent)

    # -- reading ----------------------------------------------------------------

    def nodes(self) -> Iterator[Node]:
        """Every node but the root, parents before children, in id order among siblings.
        A full walk: for reports and checks, not for a turn's bookkeeping."""
        stack = [self.root]
        while stack:
            node = stack.pop()
            if node is not self.root:
                yield node
            stack.extend(sorted(node.children.values(), key=lambda n: -n.id))

    def match(self, tokens: Sequence[int]) -> Match:
        tokens = _as_tuple(tokens)  # edges are tuples: a slice of each compares in C
        node, pos, path = self.root, 0, []
        n = len(tokens)
        while pos < n:
            child = node.children.get(tokens[pos])
            if child is None:
                break
            path.append(child)
            key = child.key
            end = pos + len(key)
            if tokens[pos:end] == key:  # the whole edge: the usual case on a long path
                pos, node = end, child
                continue
            pos += common_prefix(key, tokens, pos)
            break
        return Match(path=path, length=pos)

    # -- changing ---------------------------------------------------------------

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
        tokens = _as_tuple(tokens)
        added: list[Node] = []
        split: list[Node] = []
        node, pos = self.root, 0
        now = self.tick()
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                leaf = self._new_node(node, tuple(tokens[pos:]), make_payload(pos, len(tokens)))
                leaf.session = session
                self._use(leaf, now)
                added.append(leaf)
                return added, split
            key = child.key
            end = pos + len(key)
            common = len(key) if tokens[pos:end] == key else common_prefix(key, tokens, pos)
            if common < len(key):
                split.append(child)
                child = self.split(child, common, split_payload)
                added.append(child)
            self._use(child, now)
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
        self._digest -= _node_hash(node)
        del parent.children[node.key[0]]
        parent.children[upper.key[0]] = upper
        node.key = node.key[k:]
        node.parent = upper
        upper.children[node.key[0]] = node
        if node.resident:
            parent.resident_children -= 1
            upper.resident_children += 1
        node.payload = tail  # after the move: a change of residence is counted in upper
        self._digest += _node_hash(node)
        self._changed[node.id] = node
        self._refresh(upper)
        self._refresh(parent)
        return upper

    def remove_leaf(self, node: Node) -> None:
        if node.children or node.locks or node is self.root or node._tree is not self:
            raise ValueError(f"node {node.id} is not an unlocked leaf")
        parent = node.parent
        assert parent is not None
        self._forget(node)
        del parent.children[node.key[0]]
        if node.resident:
            parent.resident_children -= 1
        node.parent = None
        self._refresh(parent)

    def clear(self) -> None:
        """Drop every node (payloads included). The id counter and the clock go on, so a
        new node never reuses the id of a cleared one."""
        for node in self._index.values():
            node._tree = None
            node._lru = node._cold = None
            node._payload = None
            node.parent = None
        self.root.children.clear()
        self.root.resident_children = 0
        self._index.clear()
        self._lru.clear()
        self._cold.clear()
        self._changed.clear()
        self._digest = 0
        self.weight = 0

    def lock(self, path: Sequence[Node]) -> None:
        for node in path:
            node.locks += 1
            if node._lru is not None or node._cold is not None:
                self._refresh(node)

    def unlock(self, path: Sequence[Node]) -> None:
        for node in path:
            if node.locks <= 0:
                raise ValueError(f"node {node.id} is not locked")
            node.locks -= 1
            if not node.locks:
                self._refresh(node)

    def touch(self, path: Sequence[Node]) -> None:
        now = self.tick()
        for node in path:
            self._use(node, now)

    def put_first(self, nodes: Sequence[Node]) -> None:
        """Give `nodes` an LRU time before every touched node's (a negative one, still in
        clock order among such nodes): evicted first, until a `touch` makes them ordinary.
        The typed-ahead draft's entries (exokv.rank.typeahead) are kept this way."""
        now = self.tick() - COLD_OFFSET
        for node in nodes:
            self._use(node, now)

    # -- checking ---------------------------------------------------------------

    def recount(self) -> Figures:
        """The incremental figures computed from scratch by a walk of the whole tree."""
        digest = weight = count = 0
        lru, cold = [], []
        for node in self.nodes():
            count += 1
            digest += _node_hash(node)
            weight += self._size_of(node.payload)
            if node.locks:
                continue
            if not self._resident(node.payload):
                if not node.children:
                    cold.append((node.last_used, node.id))
            elif not any(self._resident(c.payload) for c in node.children.values()):
                lru.append((node.last_used, node.id))
        return Figures(
            count=count,
            digest=digest & _DIGEST_BITS,
            weight=weight,
            lru=sorted(lru),
            nonresident=sorted(cold),
        )

    def figures(self) -> Figures:
        """The incremental figures as the tree holds them."""
        return Figures(
            count=len(self),
            digest=self.digest,
            weight=self.weight,
            lru=list(self._lru),
            nonresident=list(self._cold),
        )

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
            assert self._index.get(node.id) is node, f"node {node.id} not indexed"
            assert node._tree is self
            assert node.size == self._size_of(node.payload), f"node {node.id} size"
            assert node.resident == bool(self._resident(node.payload)), f"node {node.id} resident"
            for first, child in node.children.items():
                assert child.key[0] == first
        for node in [self.root, *self._index.values()]:
            held = sum(1 for c in node.children.values() if c.resident)
            assert node.resident_children == held, f"node {node.id} resident children"
        assert seen == set(self._index), "the id index holds removed nodes"
        assert self.figures() == self.recount(), "incremental figures differ from a recount"

    # -- internals --------------------------------------------------------------

    def restore_node(
        self, parent: Node, node_id: int, key: Sequence[int], payload: Any, last_used: int = 0
    ) -> Node:
        """Put back a node that a persisted tree recorded, under its own id and LRU time
        (restoring must give every rank the tree it had). Later ids come after it."""
        if node_id in self._index or node_id <= 0 or not key or key[0] in parent.children:
            raise ValueError(f"node {node_id} cannot be restored here")
        node = self._new_node(parent, _as_tuple(key), payload, node_id)
        self._next_id = max(self._next_id, node_id + 1)
        self._use(node, last_used)
        return node

    def _new_node(
        self, parent: Node, key: tuple[int, ...], payload: Any, node_id: int | None = None
    ) -> Node:
        node = self.node_type(
            id=self._next_id if node_id is None else node_id,
            parent=parent,
            key=key,
            depth=parent.depth + len(key),
            payload=payload,
        )
        if node_id is None:
            self._next_id += 1
        parent.children[key[0]] = node
        node._tree = self
        node.size = self._size_of(payload)
        node.resident = bool(self._resident(payload))
        if node.resident:
            parent.resident_children += 1
        self.weight += node.size
        self._index[node.id] = node
        self._digest += _node_hash(node)
        self._changed[node.id] = node
        self._refresh(node)
        self._refresh(parent)
        return node

    def _forget(self, node: Node) -> None:
        if node._lru is not None:
            self._lru.remove(node._lru)
            node._lru = None
        if node._cold is not None:
            self._cold.remove(node._cold)
            node._cold = None
        del self._index[node.id]
        self._changed.pop(node.id, None)
        self._digest -= _node_hash(node)
        self.weight -= node.size
        node._tree = None

    def _use(self, node: Node, now: int) -> None:
        node.last_used = now
        self._changed[node.id] = node
        if node._lru is not None or node._cold is not None or not node.resident_children:
            self._refresh(node)  # only a leaf's place (of either order) can change

    def _refresh(self, node: Node) -> None:
        """Put `node` in the order it belongs to (resident or not), or in neither."""
        hot = cold = None
        if not node.locks and node._tree is self:
            if node.resident:
                if not node.resident_children:
                    hot = (node.last_used, node.id)
            elif not node.children:
                cold = (node.last_used, node.id)
        node._lru = _reposition(self._lru, node._lru, hot)
        node._cold = _reposition(self._cold, node._cold, cold)


def _reposition(order: SortedList, old: Key | None, new: Key | None) -> Key | None:
    """Move an entry of a sorted order from key `old` to `new` (None: not in it)."""
    if new != old:
        if old is not None:
            order.remove(old)
        if new is not None:
            order.add(new)
    return new


def _as_tuple(tokens: Sequence[int]) -> tuple[int, ...]:
    return tokens if isinstance(tokens, tuple) else tuple(tokens)


def _mix(x: int) -> int:
    """splitmix64's finalizer: a fixed, process-independent 64-bit hash of an integer."""
    x &= _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _node_hash(node: Node) -> int:
    parent = node.parent.id if node.parent is not None else -1
    return _mix(_mix(_mix(node.id) ^ node.depth) ^ (parent + 1))


def common_prefix(a: Sequence[int], b: Sequence[int], start: int = 0) -> int:
    """How many tokens of `a` equal `b` from position `start` of `b` on.

    Compares whole slices (C speed), then halves the first unequal slice until the
    mismatch is a few tokens wide.
    """
    n = min(len(a), len(b) - start)
    if n <= 0:
        return 0
    x, y = a[:n], b[start : start + n]
    if type(x) is not type(y) or type(x) not in (list, tuple):
        x, y = list(x), list(y)
    if x == y:
        return n
    lo, hi = 0, n  # x[:lo] == y[:lo] and x[:hi] != y[:hi]
    while hi - lo > _SCAN:
        mid = (lo + hi) // 2
        if x[lo:mid] == y[lo:mid]:
            lo = mid
        else:
            hi = mid
    while x[lo] == y[lo]:
        lo += 1
    return lo
