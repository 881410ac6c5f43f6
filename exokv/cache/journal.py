"""The disk tier's journal: what each turn changed in the tree of on-disk nodes.

The tree of the nodes whose arrays are in this rank's files (spilled to disk, or
a RAM node with a copy) is kept across restarts as a snapshot (`tree.json`) and a
journal (`journal.log`) of what changed since. Each turn appends one record with
only the nodes the turn changed (those the radix tree lists, and those the disk
tier marked): nodes new to the files or changed in shape (added, split, written),
nodes only used (their LRU time and hits), and nodes that left (evicted, loaded
back, dropped). A turn costs what it changed, never a walk of the tree; when the
journal grows past the snapshot, the two are compacted into a new snapshot.

A record is its body's length and CRC-32, then the body (JSON). It is appended by
the disk's writer thread after the files queued before it (exokv.cache.disk), and
synced (exokv.cache.durable): a record never names a file that is not written. A
crash can tear the last record; reading stops at the first record that does not
check out, so a new chat starts from the last whole one (exokv.cache.persist), and
a file that no record covers any more is removed.

Records are numbered (`seq`), the snapshot says up to which record it holds, and
every rank writes the same records and compacts at the same ones (both follow from
the tree, the same on every rank), so the ranks can agree on where to stop.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from exokv.cache import durable
from exokv.cache.radix import Node

# Of the snapshot: 3, files named by layer in the lineage's pool (exokv.cache.disk);
# earlier versions are not read (their files were a rank's own, named by node alone).
VERSION = 3
TREE_FILE = "tree.json"
JOURNAL_FILE = "journal.log"
MIN_COMPACT = 64 * 1024  # the journal is not compacted below this many bytes

_HEAD = struct.Struct("<II")  # the body's length and its CRC-32

OnDisk = Callable[[Node], bool]


# -- a node as the snapshot and the journal record it --------------------------------


def node_record(n: Node) -> dict[str, Any]:
    return {
        "id": n.id,
        "parent": n.parent.id if n.parent is not None else 0,
        "key": list(n.key),
        "session": n.session,
        "last_used": n.last_used,
        "hits": n.hits,
        "spans": [[*c, [list(s) for s in sp]] for c, sp in sorted(n.payload.spans.items())],
        "state": n.payload.state,
    }


def _shape(n: Node) -> tuple:
    """What a full record holds besides its use: equal shapes, equal records (a node's
    tokens change only by a split, which changes its parent and its length)."""
    spans = tuple((c, tuple(sp)) for c, sp in sorted(n.payload.spans.items()))
    parent = n.parent.id if n.parent is not None else 0
    return (parent, len(n.key), n.session, spans, n.payload.state)


# -- the record format ------------------------------------------------------------------


def encode(body: dict[str, Any]) -> bytes:
    data = json.dumps(body, separators=(",", ":")).encode()
    return _HEAD.pack(len(data), zlib.crc32(data)) + data


def read(path: Path, after: int) -> tuple[list[dict[str, Any]], str]:
    """The whole records numbered after `after`, in order, and why the file's tail was
    left out ("" when it was not): a record cut short or not matching its CRC (a crash
    while it was written), or out of sequence. Records up to `after` (the snapshot
    holds them: a crash came between a compaction's two steps) are skipped."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return [], ""
    except OSError as err:
        return [], f"unreadable ({err.strerror or err})"
    out: list[dict[str, Any]] = []
    pos = 0
    while pos < len(data):
        if pos + _HEAD.size > len(data):
            return out, "its last record is torn"
        length, crc = _HEAD.unpack_from(data, pos)
        body = data[pos + _HEAD.size : pos + _HEAD.size + length]
        if len(body) < length:
            return out, "its last record is torn"
        if zlib.crc32(body) != crc:
            return out, "a record fails its checksum"
        try:
            record = json.loads(body)
            seq = int(record["seq"])
        except (ValueError, KeyError, TypeError):
            return out, "a record is unreadable"
        pos += _HEAD.size + length
        if seq <= after:
            continue
        if seq != after + len(out) + 1:
            return out, f"record {seq} is out of sequence"
        out.append(record)
    return out, ""


def apply(record: dict[str, Any], nodes: dict[int, dict[str, Any]]) -> None:
    """Change the snapshot's nodes (by id) as `record` says."""
    for node_id in record["gone"]:
        nodes.pop(node_id, None)
    for rec in record["nodes"]:
        nodes[rec["id"]] = rec
    for node_id, last_used, hits in record["used"]:
        rec = nodes.get(node_id)
        if rec is not None:
            rec["last_used"], rec["hits"] = last_used, hits


def last_seq(root: Path) -> int:
    """The number of the last whole record in a tier directory (its snapshot's if none)."""
    try:
        seq = int(json.loads((root / TREE_FILE).read_text()).get("seq", 0))
    except (OSError, ValueError, AttributeError):
        return 0
    records, _ = read(root / JOURNAL_FILE, seq)
    return seq + len(records)


# -- writing: one record per turn, compacted now and then ----------------------------


Job = Callable[[], None]


class Journal:
    """This rank's journal. `on_disk(node)`: whether a node's arrays are in its file.
    `view` is what snapshot + journal say: a node's shape and use by id. Its writes
    are jobs for the disk's writer thread, to run after the files they name."""

    def __init__(self, root: Path, classes: list[Any], on_disk: OnDisk) -> None:
        self.root = root
        self.classes = classes
        self.on_disk = on_disk
        self.view: dict[int, tuple[tuple, tuple[int, int]]] = {}
        self.seq = 0  # the last record's number
        self.marked: set[int] = set()  # ids whose place (RAM, disk, a copy) changed
        self.snapshot_bytes = 0
        self.journal_bytes = 0
        self.stale = False  # the files were all removed (clear): the next record compacts
        self.lineage = ""  # the tree's lineage: its pool's name (exokv.cache.persist)

    def forget_all(self) -> None:
        self.view, self.marked, self.stale = {}, set(), True

    def mark(self, node_id: int) -> None:
        self.marked.add(node_id)

    def record(self, changed: Iterable[Node], tree: Any) -> Job | None:
        """The record of what `changed` nodes and the marked ones did: the job that
        appends it (or a compaction), None when nothing changed."""
        if self.stale:
            self.seq += 1
            return self.compact(tree)
        ids = {n.id for n in changed} | self.marked
        self.marked = set()
        full, used, gone = [], [], []
        for node_id in sorted(ids):
            node = tree.find(node_id)
            old = self.view.get(node_id)
            if node is None or node.payload is None or not self.on_disk(node):
                if old is not None:
                    gone.append(node_id)
                    del self.view[node_id]
                continue
            shape, use = _shape(node), (node.last_used, node.hits)
            if old is None or old[0] != shape:
                full.append(node_record(node))
            elif old[1] != use:
                used.append([node_id, *use])
            else:
                continue
            self.view[node_id] = (shape, use)
        if not (full or used or gone):
            return None
        self.seq += 1
        body = {"seq": self.seq, "next_id": tree._next_id, "clock": tree.clock}
        data = encode({**body, "nodes": full, "used": used, "gone": gone})
        self.journal_bytes += len(data)
        if self.journal_bytes > max(self.snapshot_bytes, MIN_COMPACT):
            return self.compact(tree)  # this turn's changes are in the snapshot
        return lambda: self._append(data)

    def compact(self, tree: Any) -> Job:
        """A new snapshot of every node on disk, the journal to start afresh: the job
        that writes them (it raises OSError). A walk of the tree: when the journal
        outgrew the snapshot, and at start, /save and quit."""
        nodes, self.view = [], {}
        for n in tree.nodes():
            if n.payload is not None and self.on_disk(n):
                nodes.append(node_record(n))
                self.view[n.id] = (_shape(n), (n.last_used, n.hits))
        doc = {
            "version": VERSION,
            "lineage": self.lineage,
            "classes": [list(c) for c in self.classes],
            "next_id": tree._next_id,
            "clock": tree.clock,
            "seq": self.seq,
            "nodes": nodes,
        }
        text = json.dumps(doc, separators=(",", ":"))
        self.snapshot_bytes, self.journal_bytes = len(text), 0
        self.marked, self.stale = set(), False
        return lambda: self._write_snapshot(text)

    def _write_snapshot(self, text: str) -> None:
        # The snapshot first, then the emptied journal: a crash between the two leaves
        # records the snapshot already holds, which reading skips by their numbers.
        tmp = self.root / (TREE_FILE + ".tmp")
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            durable.sync_file(f.fileno())
        durable.replace(tmp, self.root / TREE_FILE)
        with open(self.root / JOURNAL_FILE, "wb") as f:
            durable.sync_file(f.fileno())
        durable.sync_dir(self.root)  # the journal may be new

    def _append(self, data: bytes) -> None:
        with open(self.root / JOURNAL_FILE, "ab") as f:
            f.write(data)
            f.flush()
            durable.sync_file(f.fileno())
