"""The disk tier's tree, kept across restarts: `tree.json` beside each rank's files.

At shutdown every rank spills what it holds in RAM (see DiskTier.close), and on
/save it writes the session's path to disk too (DiskTier.save); both then write
the tree of the nodes whose files hold them: token edges, ids, sessions, LRU clock, the window
spans and state flags of each node. Every rank writes the same tree, so at start
the ranks gather its digest: equal, and every earlier conversation is warm on disk;
different (or unreadable on some rank), and every rank starts cold, saying why.
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from exokv.cache.prefix_cache import Payload, PrefixCache
from exokv.cache.radix import Node
from exokv.collectives import Group

VERSION = 2  # 2: a file says where it ends (version 1 files are not read)
TREE_FILE = "tree.json"


OnDisk = Callable[[Node], bool]


def _on_disk_subtree(pc: PrefixCache, lost: set[int], on_disk: OnDisk) -> list[Node]:
    """Nodes whose whole path is on disk and written, parents first."""
    keep: set[int] = {pc.tree.root.id}
    out = []
    for node in pc.tree.nodes():
        p = node.parent
        if (
            p is not None
            and p.id in keep
            and node.payload is not None
            and on_disk(node)
            and node.id not in lost
        ):
            keep.add(node.id)
            out.append(node)
    return out


def describe(pc: PrefixCache, lost: set[int], on_disk: OnDisk) -> dict[str, Any]:
    nodes = [
        {
            "id": n.id,
            "parent": n.parent.id if n.parent is not None else 0,
            "key": list(n.key),
            "session": n.session,
            "last_used": n.last_used,
            "hits": n.hits,
            "spans": [[*c, [list(s) for s in sp]] for c, sp in sorted(n.payload.spans.items())],
            "state": n.payload.state,
        }
        for n in _on_disk_subtree(pc, lost, on_disk)
    ]
    return {
        "version": VERSION,
        "classes": [list(c) for c in pc.classes],
        "next_id": pc.tree._next_id,
        "clock": pc.tree.clock,
        "nodes": nodes,
    }


def save(pc: PrefixCache, root: Path, lost: set[int], on_disk: OnDisk) -> None:
    text = json.dumps(describe(pc, lost, on_disk), separators=(",", ":"))
    tmp = root / (TREE_FILE + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / TREE_FILE)


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


def restore(pc: PrefixCache, root: Path, group: Group) -> tuple[list[Node], str]:
    """Rebuild the persisted tree into `pc` (on-disk nodes), if every rank holds the
    same one. Returns (the nodes restored, why the cache starts cold or "")."""
    doc, why = _read(root)
    if doc is not None and [tuple(c) for c in doc["classes"]] != pc.classes:
        doc, why = None, "the model's cache layout changed"
    digest = zlib.crc32(json.dumps(doc, sort_keys=True).encode()) if doc else 0
    rows = group.gather([digest, 1 if why else 0]) if group.size > 1 else [[digest, 0]]
    if len({row[0] for row in rows}) != 1:
        bad = [r for r, row in enumerate(rows) if row[1]]
        return [], (
            f"rank {bad[0]}'s persisted cache is unusable; starting cold"
            if bad
            else "the ranks hold different persisted caches; starting cold"
        )
    if doc is None:
        return [], (f"{why}; starting cold" if why else "")
    by_id: dict[int, Node] = {0: pc.tree.root}
    added = []
    for rec in doc["nodes"]:
        parent = by_id.get(rec["parent"])
        if parent is None or not rec["key"]:
            continue
        key = tuple(rec["key"])
        depth = parent.depth + len(key)
        spans = {(c[0], c[1], c[2]): [tuple(s) for s in c[3]] for c in rec["spans"]}
        payload = Payload(start=depth - len(key), spans=spans, state=rec["state"], tier="disk")
        node = pc.tree.restore_node(parent, rec["id"], key, payload, rec["last_used"])
        node.session, node.hits = rec["session"], rec["hits"]
        by_id[node.id] = node
        added.append(node)
    pc.tree._next_id = max(pc.tree._next_id, int(doc["next_id"]))
    pc.tree.clock = max(pc.tree.clock, int(doc["clock"]))
    return added, ""
