"""The disk tier's decisions: spill, load and drop, the same on every rank.

A node the plan evicts from RAM becomes an on-disk node (kept in the tree, its
payload's `tier` "disk", its arrays written by this rank's DiskStore) when every
rank's disk budget allows; else the least recently used on-disk leaves are dropped
to make room, and failing that the node leaves the tree. Every rank's disk bytes
are the tree's on-disk counts times that rank's gathered rates, so every rank
decides alike with no more communication than the turn's one collective.

RAM nodes stay an upper part of the tree (a spilled node is a RAM leaf; a load
brings a whole path back), so the plan, seeing only RAM nodes, still evicts leaves.

A load can fail on one rank only (a missing, truncated or corrupt file). The ranks
agree on it with one small gather, made only on turns whose hit reaches on-disk
nodes (identical on every rank: the tree says so): the hit stops before the first
node any rank could not read, which is dropped with its subtree.

/save writes a session's path to disk without leaving RAM: its nodes get *copies*
(files counted against the disk budget), so evicting one later writes nothing, and
the persisted tree lets a new process, even after a crash, start with the session
warm. Every turn does the same for what it changed (write-through, `after_turn`):
its new RAM nodes get copies as the disk budget allows, written by the store's
thread after the reply, and the journal (exokv.cache.journal) records the turn's
changes once those files are written. Which nodes get a copy follows from the tree
and the gathered budgets, the same on every rank; the tree itself (what is in RAM,
what on disk) does not change.

A load checks that the file holds exactly the positions the tree's record needs
(a file is named by its node's id, and a node keeps its id through splits), and
takes each layer from whichever file of the node holds it: the files are named by
layer, so after a re-plan a rank reads what other ranks wrote for its new layers
(exokv.cache.disk). With replicas (exokv.hosts.replicas) a rank's disk also holds
the copies of other ranks' files: their bytes count against its budget, computed
from the same gathered rates, and they are dropped with their nodes.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx

from exokv.cache import kinds, persist, spans
from exokv.cache.disk import DiskStore
from exokv.cache.journal import Journal
from exokv.cache.kinds import StorageClass
from exokv.cache.prefix_cache import Payload, PrefixCache, _slices
from exokv.cache.radix import Node, common_prefix
from exokv.collectives import Group
from exokv.core.records import CacheEvent

RAM, DISK = "ram", "disk"


def is_disk(node: Node) -> bool:
    return node.payload is not None and node.payload.tier == DISK


class DiskTier:
    def __init__(
        self,
        cache: PrefixCache,
        store: DiskStore,
        group: Group,
        budget: int,
        warn: Callable[[str], None] | None = None,
        first_layer: int = 0,
        held_by: Sequence[Sequence[int]] = (),
    ) -> None:
        """`first_layer`: the model's index of this rank's first layer (files name their
        layers by it); `held_by[r]`: the ranks whose files rank r's host keeps copies of."""
        self.cache = cache
        self.first_layer = first_layer
        self.held_by = [list(h) for h in held_by] or [[] for _ in range(group.size)]
        self.written: list[int] = []  # nodes whose files were written since take_written
        self.store = store
        self.group = group
        self.budget = budget  # this rank's
        self.budgets: list[int] = [budget] * group.size  # every rank's, as last gathered
        self.rates: list[dict[StorageClass, int]] = []
        self.totals: dict[StorageClass, int] = dict.fromkeys(cache.classes, 0)
        self.stopped = ""  # why spilling stopped (agreed); "" while it goes on
        self.events: list[CacheEvent] = []
        self.decision = 0
        self.pins: frozenset[str] = frozenset()  # pinned sessions (Coordinator.set_pins)
        self.node_bytes: Callable[[Node], list[int]] = lambda n: [0] * group.size
        self._warn = warn or (lambda text: print(f"exokv: warning: {text}", file=sys.stderr))
        self.spills = self.loads = self.drops = 0
        # RAM nodes /save also wrote to disk: id -> (what the file holds, its counts).
        # Their bytes count against the disk budget; evicting one its file still covers
        # (a split since keeps the lower part's id: the file holds more) is a spill with
        # nothing to write.
        self.copies: dict[int, tuple[tuple, dict[StorageClass, int]]] = {}
        self.journal = Journal(store.root, cache.classes, self.on_disk)

    # -- the numbers in the turn's collective ----------------------------------------

    def local_numbers(self) -> list[int]:
        return [self.budget, 1 if self.store.failed else 0]

    def absorb(self, rows: Sequence[Sequence[int]], rates: list[dict[StorageClass, int]]) -> None:
        """Take every rank's disk budget and write status from the gathered rows' tails."""
        self.rates = rates
        self.budgets = [int(row[-2]) for row in rows]
        failed = [r for r, row in enumerate(rows) if row[-1]]
        if failed and not self.stopped:
            why = self.store.failed if failed[0] == self.group.rank else "a write failed"
            self.stopped = f"disk full or unwritable on rank {failed[0]} ({why}): spilling stopped"
            if self.group.rank == 0:  # one warning, not one per rank
                self._warn(self.stopped)
            self.events.append(self._event("drop", None, self.stopped))

    def disk_bytes(self) -> list[int]:
        """Every rank's disk bytes, its own files and the copies it keeps of others'."""
        own = self.own_bytes()
        return [b + self.replica_bytes(r, own) for r, b in enumerate(own)]

    def own_bytes(self) -> list[int]:
        return [sum(n * rate.get(c, 0) for c, n in self.totals.items()) for rate in self.rates]

    def replica_bytes(self, rank: int, own: list[int] | None = None) -> int:
        """What rank `rank`'s host keeps of other ranks' files (their own bytes)."""
        own = own if own is not None else self.own_bytes()
        held = self.held_by[rank] if rank < len(self.held_by) else []
        return sum(own[s] for s in held if s < len(own))

    def take_written(self) -> list[int]:
        """The nodes whose files were written since the last call (for their replicas)."""
        out, self.written = self.written, []
        return out

    # -- spill (or drop) what the plan evicts from RAM -------------------------------

    def remove(self, node: Node, reason: str, evict_event: CacheEvent) -> None:
        """The plan evicts `node` (a RAM leaf) from RAM: spill it if the disk allows."""
        if self.stopped or not self.has_copy(node):
            self._forget_copy(node.id)  # once writing stopped, a copy may be a failed write
        if self.has_copy(node) or (
            not self.stopped and self._make_room(self.node_bytes(node), node)
        ):
            evict_event.kind = "spill"
            self.events.append(evict_event)
            self._spill(node)
            return
        self.events.append(evict_event)
        self._drop_children(node, "its parent left the cache")
        self.cache.evict(node)

    def _make_room(self, size: list[int], node: Node) -> bool:
        """Drop on-disk leaves, least recently used first (a pinned session's after every
        other), until `size` more fits on every rank's disk. The tree keeps them in
        order, so no walk (a leaf is never an ancestor of `node`)."""
        while not self._fits(size):
            victim = self._oldest_on_disk(node)
            if victim is not None:
                self.drop(victim, "disk budget")
            elif not self._forget_oldest_copy(node):
                return False
        return True

    def _oldest_on_disk(self, node: Node) -> Node | None:
        pinned: Node | None = None
        for n in self.cache.tree.lru_nonresident():
            if n is node:
                continue
            if n.session not in self.pins:
                return n
            pinned = pinned or n
        return pinned

    def _forget_oldest_copy(self, node: Node) -> bool:
        """Free the disk a /save copy holds (its node stays in RAM); False if none.
        Copies are few (a session's path per /save): a scan is cheap."""
        tree = self.cache.tree
        for gone in [i for i in self.copies if tree.find(i) is None]:
            self._forget_copy(gone)
        copies = [n for i in self.copies if (n := tree.find(i)) is not node]
        if not copies:
            return False
        self._forget_copy(min(copies, key=lambda n: (n.last_used, n.id)).id)
        return True

    def _fits(self, size: list[int]) -> bool:
        held = self.disk_bytes()
        return all(h + s <= b for h, s, b in zip(held, size, self.budgets, strict=True))

    def _spill(self, node: Node) -> None:
        """`node` leaves RAM for disk: its file is written, unless /save wrote it already."""
        written = self.has_copy(node)
        self._forget_copy(node.id, keep_file=written)
        arrays = None if written else self._arrays(node)
        self.cache.detach(node)
        self._count(node, +1)
        if arrays is not None:
            self.store.write(node.id, arrays)
            self.written.append(node.id)
        self.spills += 1

    # -- copies: RAM nodes with a file too (/save) ------------------------------------

    def has_copy(self, node: Node) -> bool:
        copy = self.copies.get(node.id)
        return copy is not None and _covers(copy[0], node)

    def on_disk(self, node: Node) -> bool:
        """Whether `node`'s arrays are in its file (after a restart, it would be there)."""
        return is_disk(node) or self.has_copy(node)

    def _forget_copy(self, node_id: int, keep_file: bool = False) -> None:
        copy = self.copies.pop(node_id, None)
        if copy is None:
            return
        self.journal.mark(node_id)
        for c, n in copy[1].items():
            self.totals[c] = self.totals.get(c, 0) - n
        if not keep_file:
            self.store.delete(node_id)

    def save(self, path: Sequence[Node]) -> tuple[int, str]:
        """/save: write the RAM nodes of `path` to disk too (they stay in RAM, so the
        chat goes on as before) and persist the tree, so a new process (even after this
        one is killed) starts with `path` warm on disk. Every rank alike, from the tree
        and the gathered budgets. Returns (tokens of `path` on disk, why not more)."""
        reached, why = 0, ""
        for node in path:
            if not self.on_disk(node):
                if self.stopped:
                    why = "the disk tier is full or unwritable"
                    break
                self._forget_copy(node.id)
                if not self._make_room(self.node_bytes(node), node):
                    why = "the disk budget is full"
                    break
                self._copy(node)
            reached = node.depth
        self.store.flush()
        self.persist()
        return reached, why

    def _keep_as_copy(self, node: Node) -> None:
        counts = self.cache.counts(node)
        self.copies[node.id] = (_signature(node), counts)
        for c, n in counts.items():
            self.totals[c] = self.totals.get(c, 0) + n
        self.journal.mark(node.id)

    def _copy(self, node: Node, batch: dict[int, Any] | None = None) -> None:
        """Write RAM node `node` to disk too (in the background; with `batch`, when the
        caller queues it); it stays in RAM."""
        arrays = self._arrays(node)
        if batch is not None:
            batch[node.id] = arrays
        else:
            self.store.write(node.id, arrays)
        self.written.append(node.id)
        self._keep_as_copy(node)

    def _arrays(self, node: Node) -> dict[str, Any]:
        """What a node's file holds (see `_arrays`), each leaf named by the model's layer."""
        pc = self.cache
        obj = _arrays(node, [leaf.cls for leaf in pc.window_leaves])
        obj["at"] = {
            name: [self._where(leaf) for leaf in leaves]
            for name, leaves in (
                ("kv", pc.kv_leaves),
                ("windows", pc.window_leaves),
                ("states", pc.state_leaves),
            )
        }
        return obj

    def _where(self, leaf: kinds.Leaf) -> list[int]:
        """A leaf's place in the whole model: its layer, and its index in a CacheList."""
        return [self.first_layer + leaf.layer, -1 if leaf.sub is None else leaf.sub]

    def after_turn(self, changed: Sequence[Node]) -> None:
        """Write-through: give the turn's `changed` RAM nodes a copy on disk where every
        rank's disk budget has room (nothing is dropped for it: a copy only saves a later
        spill its write), parents first; then append the turn's journal record. The
        writes and the record are the store thread's, after the reply."""
        batch: dict[int, Any] = {}
        if not self.stopped:
            tree = self.cache.tree
            for node in sorted(changed, key=lambda n: n.depth):
                if (
                    tree.find(node.id) is not node
                    or is_disk(node)
                    or self.has_copy(node)
                    or not (node.parent is tree.root or self.on_disk(node.parent))
                ):
                    continue  # gone, on disk already, or out of reach after a restart
                size = self.node_bytes(node)
                self._forget_copy(node.id)  # one that no longer covers the node
                if not self._fits(size):
                    break  # the budget is full: the rest waits for a later turn's room
                self._copy(node, batch)
        self.store.write_batch(batch, self.journal.record(changed, self.cache.tree))

    def persist(self) -> None:
        """Write the tree of what is on disk (and its written files) for the next run."""
        write = self.journal.compact(self.cache.tree)
        self.store.flush()
        try:
            write()
        except OSError as err:
            self._warn(f"could not persist the KV cache tree: {err}")

    # -- drop from disk ------------------------------------------------------------

    def drop(self, node: Node, reason: str) -> None:
        """Remove an on-disk node and everything below it from the tree and the disk."""
        self._drop_children(node, reason)
        self.events.append(self._event("drop", node, reason))
        self._count(node, -1)
        self.cache.tree.remove_leaf(node)
        self.store.delete(node.id)
        node.payload = None
        self.drops += 1

    def _drop_children(self, node: Node, reason: str) -> None:
        for child in list(node.children.values()):
            self.drop(child, reason)

    def _count(self, node: Node, sign: int) -> None:
        self.journal.mark(node.id)  # spilled, loaded or dropped
        for c, n in self.cache.counts(node).items():
            self.totals[c] = self.totals.get(c, 0) + sign * n

    # -- load: a hit reaching on-disk nodes ----------------------------------------

    def load(self, used: list[Node]) -> int:
        """Bring the on-disk nodes of `used` back to RAM; returns how many leading
        nodes of `used` are usable (the same on every rank)."""
        disk = [i for i, n in enumerate(used) if is_disk(n)]
        if not disk:
            return len(used)
        first_bad, loaded, why = len(used), {}, ""
        for i in disk:
            objs, why = self.store.read(used[i].id)
            payload = self._payload(used[i], objs) if objs is not None else None
            if payload is None:
                first_bad, why = i, why or "unreadable contents"
                break
            loaded[i] = payload
        rows = self.group.gather([first_bad]) if self.group.size > 1 else [[first_bad]]
        agreed = min(row[0] for row in rows)
        for i in disk:
            if i >= agreed:
                break
            node = used[i]
            self._count(node, -1)
            self.cache.attach(node, loaded[i])
            self._keep_as_copy(node)  # its file holds it still: nothing to write again
            self.loads += 1
            self.events.append(self._event("load", node, "hit on disk"))
        if agreed < len(used):
            rank = next(r for r, row in enumerate(rows) if row[0] == agreed)
            # The same reason on every rank (events are compared across ranks); the
            # rank that failed says why on its own stderr.
            reason = f"unreadable on rank {rank}" + (f": {why}" if self.group.size == 1 else "")
            if rank == self.group.rank and why != "its write failed":  # that was warned of
                where = f"rank {rank}: " if self.group.size > 1 else ""
                self._warn(
                    f"{where}disk tier entry {used[agreed].id} ({self.store.path(used[agreed].id)})"
                    f" is unreadable ({why}): its tokens are prefilled again"
                )
            self.drop(used[agreed], reason)
        return agreed

    # -- insert: a turn writing through on-disk nodes --------------------------------

    def before_insert(
        self, path: list[Node], tokens: Sequence[int], fill: Callable[[int, int], Payload]
    ) -> None:
        """A turn's insert of `tokens` walks `path`. Its on-disk nodes the turn ran
        entirely get the turn's own arrays (back in RAM); one the turn leaves inside
        its edge is split there: the head from the turn's arrays, the tail still on
        disk (its file holds the whole old edge; a load takes the tail's part).
        `fill(start, end)` is a payload of the turn's cache for those positions."""
        for node in path:
            if not is_disk(node):
                continue
            self._count(node, -1)
            common = common_prefix(node.key, tokens, node.start)
            if common < len(node.key):
                head = self.cache.tree.split(
                    node, common, lambda p, k: (fill(p.start, p.start + k), _tail(p, k))
                )
                self._count(node, +1)
                self.cache.attach(head, head.payload)
                self.events.append(self._event("add", head, "split off an entry on disk"))
                return
            self.cache.attach(node, fill(node.start, node.depth))
            self.store.delete(node.id)
            self.events.append(self._event("load", node, "run again by this turn"))

    def _payload(self, node: Node, objs: list[Any]) -> Payload | None:
        """A RAM payload from an on-disk node's record and its files' contents (each
        layer from a file that holds it), or None when they do not hold exactly what the
        record needs (a file from another run, or cut short: a miss, never a wrong answer)."""
        record: Payload = node.payload
        try:
            found = _by_layer([o for o in objs if _holds(o, node)])
            p = Payload(start=record.start, spans=dict(record.spans), state=record.state)
            length = len(node.key)
            p.kv = []
            for leaf in self.cache.kv_leaves:
                obj, i = found[("kv", *self._where(leaf))]
                kv, skip = obj["kv"][i], record.start - int(obj["start"])
                take = skip == 0 and _seq_len(kv) == length
                p.kv.append(kv if take else kinds.take(kv, skip, skip + length))
            if any(_seq_len(kv) != length for kv in p.kv):
                return None
            p.windows = []
            for leaf in self.cache.window_leaves:
                obj, i = found[("windows", *self._where(leaf))]
                held = [tuple(x) for x in obj["spans"][i]]
                p.windows.append(_slices(list(obj["windows"][i]), held, record.spans[leaf.cls]))
            p.states = []
            if record.state:
                fresh = self.cache.new_cache()
                for leaf in self.cache.state_leaves:
                    obj, i = found[("states", *self._where(leaf))]
                    state, meta = obj["states"][i]
                    c = kinds.get(fresh, leaf)
                    c.state = state
                    if meta:
                        c.meta_state = meta
                    p.states.append(c)
            mx.eval(p.kv, p.windows)  # owned arrays: a later spill writes them from a thread
            p.nbytes = kinds.nbytes([p.kv, p.windows, [kinds.arrays(s.state) for s in p.states]])
            return p
        except (KeyError, TypeError, ValueError, AttributeError, IndexError):
            return None

    # -- across restarts (exokv.cache.persist) ------------------------------------------

    def restore(self) -> str:
        """Start with the persisted tree, on disk: this host's newest (a re-plan may have
        given this rank another number), the files in its lineage's pool. Returns why not
        ("" when it did)."""
        began = time.time()
        persist.adopt_newest(self.store.root)
        found = persist.restore(self.cache, self.store.root, self.group)
        self.store.use_pool(found.lineage, found.before)
        self.journal.lineage = found.lineage
        self.copies = {}
        for node in found.nodes:
            self._count(node, +1)
        # Files no record covers (any more), and pools no tree here names.
        self.store.remove_orphans({n.id for n in found.nodes}, began)
        self.store.sweep_pools(persist.lineages(self.store.root.parent) | {found.lineage})
        self.store.sweep()
        self.journal.seq = found.seq
        self.persist()  # a fresh snapshot: a torn record is gone for good
        return found.note

    def close(self) -> None:
        """Spill what RAM holds (parents first, as the disk budget allows: the same
        on every rank), wait for the writes, persist the tree and give the directory up
        to the next chat."""
        if not self.stopped and not self.store.failed:
            for node in list(self.cache.tree.nodes()):
                if node.payload is None or is_disk(node) or node.locks:
                    continue
                parent = node.parent
                if parent is not self.cache.tree.root and not is_disk(parent):
                    continue  # its parent stayed in RAM: not reachable after a restart
                if self.has_copy(node) or self._make_room(self.node_bytes(node), node):
                    self._spill(node)
        self.store.flush()
        self.persist()
        self.store.release()

    # -- reporting -------------------------------------------------------------------

    def take_events(self, decision: int) -> list[CacheEvent]:
        out, self.events = self.events, []
        for e in out:
            e.decision = decision
        return out

    def _event(self, kind: str, node: Node | None, reason: str) -> CacheEvent:
        return CacheEvent(
            kind=kind,
            decision=self.decision,
            entry=node.id if node is not None else 0,
            tokens=len(node.key) if node is not None else 0,
            bytes=self.node_bytes(node) if node is not None else [0] * self.group.size,
            session=node.session if node is not None else "",
            reason=reason,
        )

    def clear(self) -> None:
        for node in list(self.cache.tree.nodes()):
            if is_disk(node) or node.id in self.copies:
                self.store.delete(node.id)
        self.copies = {}
        self.totals = dict.fromkeys(self.cache.classes, 0)
        self.journal.forget_all()


def _arrays(node: Node, window_classes: list[StorageClass]) -> dict[str, Any]:
    """What a node's file holds: its arrays, each state layer's state, and the
    positions they cover (a later split leaves the node only part of them)."""
    p: Payload = node.payload
    states = [[s.state, getattr(s, "meta_state", "")] for s in p.states]
    spans = [[list(x) for x in p.spans.get(c, [])] for c in window_classes]
    # Copies of the lists: the writer thread reads them after this turn, and a later
    # turn lending the node's K/V (PrefixCache.fetch) replaces their items in place.
    return {
        "start": p.start,
        "end": node.depth,
        "kv": list(p.kv),
        "windows": [list(w) for w in p.windows],
        "states": states,
        "spans": spans,
    }


def _signature(node: Node) -> tuple:
    """What a node's file holds: its positions, whether a state, its window spans."""
    p: Payload = node.payload
    held = {c: [tuple(x) for x in sp] for c, sp in p.spans.items()}
    return (p.start, node.depth, p.state, held)


def _covers(held: tuple, node: Node) -> bool:
    """Whether a file holding `held` (a `_signature`) has everything `node` needs."""
    start, end, state, windows = held
    p: Payload = node.payload
    if not (start <= p.start and end == node.depth and (state or not p.state)):
        return False
    for c, want in p.spans.items():
        have = windows.get(c, [])
        if not all(any(x <= a and b <= y for x, y in have) for a, b in want):
            return False
    return True


def _holds(obj: Any, node: Node) -> bool:
    """Whether a file's positions cover what `node`'s record needs (it may hold more)."""
    record: Payload = node.payload
    skip, end = record.start - int(obj["start"]), int(obj["end"])
    return skip >= 0 and end >= node.depth and not (record.state and end != node.depth)


def _by_layer(objs: list[Any]) -> dict[tuple[str, int, int], tuple[Any, int]]:
    """Each leaf's (file, index) by (kind, the model's layer, CacheList index): the first
    file that holds it."""
    out: dict[tuple[str, int, int], tuple[Any, int]] = {}
    for obj in objs:
        for name, places in obj["at"].items():
            for i, (layer, sub) in enumerate(places):
                out.setdefault((name, int(layer), int(sub)), (obj, i))
    return out


def _seq_len(kv: Any) -> int:
    first = kv
    while isinstance(first, tuple | list):
        first = first[0]
    return int(first.shape[kinds.SEQ_AXIS])


def _tail(p: Payload, k: int) -> Payload:
    """The record of an on-disk payload's part after its first k tokens."""
    cut = p.start + k
    tail = Payload(start=cut, state=p.state, tier=DISK)
    tail.spans = {c: spans.clip(held, cut, cut + 10**12) for c, held in p.spans.items()}
    return tail
