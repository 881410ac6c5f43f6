"""The disk tier's tree, kept across restarts: `tree.json` and `journal.log` beside
each rank's files (written by exokv.cache.journal).

The snapshot lists the nodes whose files hold them (token edges, ids, sessions, LRU
clock, the window spans and state flags of each node) as of a journal record; the
journal, what each turn changed since. At start every rank reads both, and the
ranks gather the snapshot's digest and how far each journal reads whole: equal
snapshots, and every rank replays the records all of them hold whole (a record a
crash tore on one rank is dropped on all, with one line), so every earlier
conversation is warm on disk; different (or unreadable on some rank), and every
rank starts cold, saying why.

A tree has a lineage, the name of the pool its files are in on each host (exokv.cache.disk).
Every start draws a new one (rank 0's, in the same gather) and the pool takes its
name: two chats that both started from one persisted tree (a host that was a rank of
each) then never read each other's later files as their own, whose node ids they
share.
"""

from __future__ import annotations

import json
import os
import random
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from exokv.cache import journal
from exokv.cache.journal import TREE_FILE, VERSION
from exokv.cache.prefix_cache import Payload, PrefixCache
from exokv.cache.radix import Node
from exokv.collectives import Group
from exokv.state.locks import LockHeld, hold


def _read(root: Path) -> tuple[dict[str, Any] | None, str]:
    path = root / TREE_FILE
    if not path.exists():
        return None, ""
    try:
        doc = json.loads(path.read_text())
        if doc.get("version") != VERSION:
            return None, f"{path} has version {doc.get('version')}"
        return doc, ""
    except (OSError, ValueError) as err:
        return None, f"{path} is unreadable ({err})"


@dataclass
class Restored:
    """What a start found: the nodes restored (on disk), a line to show or "", the
    number of the last record replayed, and the lineage before and from now on."""

    nodes: list[Node] = field(default_factory=list)
    note: str = ""
    seq: int = 0
    before: str = ""
    lineage: str = ""


def restore(pc: PrefixCache, root: Path, group: Group) -> Restored:
    """Rebuild the persisted tree into `pc` (on-disk nodes), if every rank holds the
    same one."""
    doc, why = _read(root)
    if doc is not None and [tuple(c) for c in doc["classes"]] != pc.classes:
        doc, why = None, "the model's cache layout changed"
    seq = int(doc.get("seq", 0)) if doc else 0
    records, torn = journal.read(root / journal.JOURNAL_FILE, seq) if doc else ([], "")
    digest = zlib.crc32(json.dumps(doc, sort_keys=True).encode()) if doc else 0
    drawn = random.randrange(1, 2**31)
    local = [digest, 1 if why else 0, seq + len(records), 1 if torn else 0, drawn]
    rows = group.gather(local) if group.size > 1 else [local]
    lineage = f"{rows[0][4]:08x}"
    if _new_ranks_take_rank0s(rows):
        # A host new to this chat (`/hosts add`, a session on other hosts) has no tree:
        # it takes rank 0's, which every rank with one holds.
        shared = group.broadcast({"doc": doc, "records": records} if group.rank == 0 else None)
        if doc is None:
            doc, records = shared["doc"], shared["records"]
            seq = int(doc.get("seq", 0))
        digest = rows[0][0]
        rows = [row if row[0] else [digest, 0, rows[0][2], 0, row[4]] for row in rows]
    if len({row[0] for row in rows}) != 1:
        bad = [r for r, row in enumerate(rows) if row[1]]
        note = (
            f"rank {bad[0]}'s persisted cache is unusable; starting cold"
            if bad
            else "the ranks hold different persisted caches; starting cold"
        )
        return Restored(note=note, lineage=lineage)
    if doc is None:
        return Restored(note=f"{why}; starting cold" if why else "", lineage=lineage)
    upto = min(row[2] for row in rows)  # every rank replays what all of them hold whole
    nodes = {rec["id"]: rec for rec in doc["nodes"]}
    next_id, clock = int(doc["next_id"]), int(doc["clock"])
    for record in records[: upto - seq]:
        journal.apply(record, nodes)
        next_id, clock = max(next_id, int(record["next_id"])), max(clock, int(record["clock"]))
    added = _build(pc, nodes)
    pc.tree._next_id = max(pc.tree._next_id, next_id)
    pc.tree.clock = max(pc.tree.clock, clock)
    note = ""
    if any(row[3] for row in rows):
        where = root / journal.JOURNAL_FILE
        who = [r for r, row in enumerate(rows) if row[3]]
        whose = f"rank {who[0]}'s journal" if group.size > 1 else f"the journal ({where})"
        reason = torn if group.rank == who[0] else "its last record is torn"
        note = (
            f"{whose}: {reason} (a crash while it was written): dropped; the cache is "
            "as of the turn before, and that turn's new tokens are prefilled again"
        )
    return Restored(added, note, upto, str(doc.get("lineage", "")), lineage)


def _new_ranks_take_rank0s(rows: list[list[int]]) -> bool:
    """Whether the ranks that hold no tree (none at all, not an unusable one) should take
    rank 0's: every rank that holds one holds the same, and rank 0 is one of them."""
    held = {row[0] for row in rows if row[0]}
    fresh = [row for row in rows if not row[0] and not row[1]]
    return (
        bool(fresh)
        and held == {rows[0][0]}
        and len(fresh) + sum(1 for row in rows if row[0]) == len(rows)
    )


def adopt_newest(root: Path) -> bool:
    """Take the newest persisted tree of this host's rank folders as `root`'s own.

    A rank's folder is named by its rank number, which a re-plan changes (the host that
    was rank 2 of three is rank 1 of two): the tree it wrote last is in another folder.
    Every rank of one chat holds the same tree, so the one written last on this host is
    the one the other hosts hold too. A folder in use by a running chat is left alone.
    Returns whether a tree was taken."""
    mine = _written_at(root)
    best, when = None, mine
    for other in sorted(root.parent.glob("rank*")):
        at = _written_at(other)
        if other != root and at > when:
            best, when = other, at
    if best is None:
        return False
    try:
        fd = hold(best / "lock", {"what": "disk tier (adopted)"})
    except (LockHeld, OSError):
        return False
    try:
        for name in (TREE_FILE, journal.JOURNAL_FILE):
            data = (best / name).read_bytes() if (best / name).exists() else b""
            (root / (name + ".tmp")).write_bytes(data)
            (root / (name + ".tmp")).replace(root / name)
    except OSError:
        return False
    finally:
        os.close(fd)
    return True


def lineages(parent: Path) -> set[str]:
    """The lineages the persisted trees of the rank folders in `parent` name."""
    out = set()
    for folder in parent.glob("rank*"):
        doc, _ = _read(folder)
        if doc is not None and doc.get("lineage"):
            out.add(str(doc["lineage"]))
    return out


def _written_at(folder: Path) -> float:
    """When the tree in `folder` last changed (0: none there)."""
    times = []
    for name in (TREE_FILE, journal.JOURNAL_FILE):
        try:
            times.append((folder / name).stat().st_mtime)
        except OSError:
            continue
    return max(times) if (folder / TREE_FILE).exists() and times else 0.0


def _build(pc: PrefixCache, nodes: dict[int, dict[str, Any]]) -> list[Node]:
    """The records as on-disk nodes, parents first (a split's upper part has the
    higher id); a record whose parent is not there is left out (its file is removed)."""
    below: dict[int, list[dict[str, Any]]] = {}
    for rec in nodes.values():
        below.setdefault(rec["parent"], []).append(rec)
    added: list[Node] = []
    stack = [pc.tree.root]
    while stack:
        parent = stack.pop()
        for rec in sorted(below.get(parent.id, []), key=lambda r: r["id"]):
            if not rec["key"]:
                continue
            key = tuple(rec["key"])
            depth = parent.depth + len(key)
            spans = {(c[0], c[1], c[2]): [tuple(s) for s in c[3]] for c in rec["spans"]}
            payload = Payload(start=depth - len(key), spans=spans, state=rec["state"], tier="disk")
            try:
                node = pc.tree.restore_node(parent, rec["id"], key, payload, rec["last_used"])
            except ValueError:
                continue  # a record that does not fit the tree: a miss, never a wrong answer
            node.session, node.hits = rec["session"], rec["hits"]
            added.append(node)
            stack.append(node)
    return added
