"""A rank's disk tier: one file per tree node and layer range, written by a background thread.

A file is `<id>.L<a>-<b>.kv` (exokv.hosts.replicas.file_name): node `id`'s arrays for
layers [a, b), the rank's own. A header (magic, CRC-32 and length of the body) and a
body in safetensors (the node's arrays, and in its metadata how they nest and which
layer each belongs to). It is written to a temporary name, synced and renamed
(exokv.cache.durable), so a file is whole or absent, through a power cut too; the
CRC catches the rest (a flipped byte, a truncated copy). A file that fails any check
reads as nothing: the caller treats it as a miss.

Files live in the host's pool for the tree's lineage (`pool-<lineage>` beside the
ranks' own folders, `use_pool`), shared by the ranks on the host and named by layer,
not by rank: a rank that runs other layers after a re-plan reads what any earlier
rank here wrote for them, and the copies other hosts keep of this rank's files
(replicas) carry the same names. A read takes the layers it needs from every file of
the node that has some of them (`read`).

Writes leave the turn's critical path: `write` queues the arrays (they stay
referenced until written) and returns; a read of a node still queued is served
from the queue. The first failing write (a full disk) sets `failed`, which the
ranks agree on in the turn's collective, and no later write is attempted.
"""

from __future__ import annotations

import io
import json
import os
import queue
import shutil
import signal
import struct
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx

from exokv.cache import durable
from exokv.hosts.replicas import file_name, parse_file_name
from exokv.state.locks import LockHeld, hold

MAGIC = b"EXKV"
_HEADER = struct.Struct("<4sIQ")  # magic, crc32 of the body, body length


# -- nested arrays <-> a flat dict and a description of the nesting ------------------


def flatten(obj: Any, arrays: dict[str, mx.array], name: str = "a") -> Any:
    """A JSON description of `obj` (lists, tuples, arrays, None, ints, strings)."""
    if isinstance(obj, mx.array):
        arrays[name] = obj
        return {"a": name}
    if isinstance(obj, (list, tuple)):
        items = [flatten(x, arrays, f"{name}.{i}") for i, x in enumerate(obj)]
        return {"t" if isinstance(obj, tuple) else "l": items}
    if isinstance(obj, dict):
        return {"d": {str(k): flatten(v, arrays, f"{name}.{k}") for k, v in obj.items()}}
    if obj is None or isinstance(obj, (int, float, str)):
        return {"v": obj}
    raise TypeError(f"cannot store a {type(obj).__name__} in the disk tier")


def unflatten(spec: Any, arrays: dict[str, mx.array]) -> Any:
    if "a" in spec:
        return arrays[spec["a"]]
    if "t" in spec:
        return tuple(unflatten(x, arrays) for x in spec["t"])
    if "l" in spec:
        return [unflatten(x, arrays) for x in spec["l"]]
    if "d" in spec:
        return {k: unflatten(v, arrays) for k, v in spec["d"].items()}
    return spec["v"]


def encode(obj: Any) -> bytes:
    arrays: dict[str, mx.array] = {}
    spec = flatten(obj, arrays)
    body = io.BytesIO()
    mx.save_safetensors(body, arrays, metadata={"exokv": json.dumps(spec)})
    data = body.getvalue()
    return _HEADER.pack(MAGIC, zlib.crc32(data), len(data)) + data


def decode(data: bytes) -> Any:
    """The object `encode` stored; ValueError if the bytes do not check out."""
    if len(data) < _HEADER.size:
        raise ValueError("truncated header")
    magic, crc, length = _HEADER.unpack_from(data)
    body = data[_HEADER.size :]
    if magic != MAGIC:
        raise ValueError("not an exokv KV file")
    if len(body) != length:
        raise ValueError(f"truncated: {len(body)} of {length} bytes")
    if zlib.crc32(body) != crc:
        raise ValueError("checksum mismatch")
    arrays, meta = mx.load(io.BytesIO(body), format="safetensors", return_metadata=True)
    return unflatten(json.loads(meta["exokv"]), arrays)


# -- the store ----------------------------------------------------------------------


class DiskStore:
    """The files of one rank: its folder `root` (its lock, tree and journal) and the
    host's pool the files go to, written by one background thread."""

    def __init__(
        self,
        root: Path,
        layers: tuple[int, int] = (0, 1),
        held: Sequence[tuple[int, int]] = (),
        plan: tuple[str, int] | None = None,
    ) -> None:
        """`layers`: the [a, b) this rank runs, the range its files are named by; `held`:
        the ranges of other ranks whose copies this host keeps (dropped with the node).
        `plan`: (the chat, its plan's generation) this rank belongs to. Raises
        exokv.state.locks.LockHeld when another chat uses `root` (one process per
        directory: two would write each other's ids), OSError when unusable. A rank
        of an older plan of the same chat holding it is stopped (`take_over`)."""
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock_fd = take_over(root / "lock", plan)
        self.layers = layers
        self.held = [r for r in held if r != layers]
        self.pool = root  # the files' folder; the lineage's pool once restored (use_pool)
        self.failed = ""  # why the first write failed; nothing is written after it
        self.lost: set[int] = set()  # ids whose write failed or was never tried
        self._pending: dict[int, Any] = {}
        self._lock = threading.Lock()
        # Batches: node ids to write, then a job (the journal's record) run after them
        # and every write queued before: a record never says a file is written before
        # it is. One batch a turn wakes the writer once.
        self._queue: queue.Queue[tuple[list[int], Callable[[], None] | None]] = queue.Queue()
        self._thread = threading.Thread(target=self._write_loop, daemon=True)
        self._thread.start()

    def sweep_pools(self, keep: set[str]) -> None:
        """Remove the pools beside this rank's folder whose lineage no tree here names
        (`keep`), unless another chat has a rank folder here open (it may have one)."""
        for folder in self.root.parent.glob("rank*"):
            if folder != self.root and _in_use(folder):
                return
        for pool in self.root.parent.glob("pool-*"):
            if pool.name.removeprefix("pool-") not in keep and pool != self.pool:
                shutil.rmtree(pool, ignore_errors=True)

    def use_pool(self, lineage: str, before: str = "") -> None:
        """Keep the files in the host's pool of `lineage` from now on; the pool of the
        tree's earlier lineage `before` becomes it (renamed: a second chat that started
        from the same persisted tree finds no files to mistake for its own)."""
        pool = self.root.parent / f"pool-{lineage}"
        old = self.root.parent / f"pool-{before}"
        if before and before != lineage and old.is_dir():
            try:
                old.rename(pool)
            except OSError:
                pass  # another rank on this host renamed it first
        pool.mkdir(parents=True, exist_ok=True)
        self.pool = pool

    def path(self, node_id: int) -> Path:
        """Where this rank writes node `node_id`'s file."""
        return self.pool / file_name(node_id, self.layers)

    def write(self, node_id: int, obj: Any) -> None:
        """Queue `obj` (evaluated arrays) to be written as node `node_id`'s file."""
        self.write_batch({node_id: obj})

    def write_batch(self, objs: dict[int, Any], then: Callable[[], None] | None = None) -> None:
        """Queue every node's file of `objs`, and `then` to run on the writer thread once
        they and the writes queued before are done. An exception `then` raises (a full
        disk) stops writing as a failed write does."""
        with self._lock:
            self._pending.update(objs)
        if objs or then is not None:
            self._queue.put((list(objs), then))

    def read(self, node_id: int) -> tuple[list[Any] | None, str]:
        """(the objects of the node's files holding any of this rank's layers, "") or
        (None, why none can be read). This rank's own file when it is whole (it holds
        every layer asked for), else every file of the node with some of them."""
        with self._lock:
            if node_id in self._pending:
                return [self._pending[node_id]], ""
        if node_id in self.lost:
            return None, "its write failed"
        obj, why = _read_file(self.path(node_id))
        if obj is not None:
            return [obj], ""
        objs = []
        for path in sorted(self.pool.glob(f"{node_id}.L*.kv")):
            parsed = parse_file_name(path.name)
            if parsed is None or path == self.path(node_id) or not _overlap(parsed[1], self.layers):
                continue
            other, other_why = _read_file(path)
            if other is not None:
                objs.append(other)
            else:
                why = other_why
        return (objs, "") if objs else (None, why)

    def delete(self, node_id: int) -> None:
        """Remove the node's file, and the copies of other ranks' this host keeps."""
        with self._lock:
            self._pending.pop(node_id, None)  # a queued write of it is skipped
        self.lost.discard(node_id)
        for layers in [self.layers, *self.held]:
            _unlink(self.pool / file_name(node_id, layers))

    def remove_orphans(self, known: set[int], before: float) -> None:
        """Remove the pool's files of nodes not in `known` (any layers) written before
        `before` (time.time()): later ones are new nodes another rank on this host is
        writing already."""
        for path in self.pool.glob("*.kv"):
            parsed = parse_file_name(path.name)
            if parsed is None or parsed[0] in known:
                continue
            try:
                if path.stat().st_mtime < before:
                    path.unlink()
            except OSError:
                pass  # gone already

    def flush(self) -> None:
        """Wait until every queued write is done."""
        self._queue.join()

    def release(self) -> None:
        """Give the directory up to the next chat (after `flush`)."""
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    def sweep(self) -> None:
        """Remove the temporary files of writes a crash cut short."""
        for p in self.pool.glob("*.tmp"):
            try:
                p.unlink()
            except OSError:
                pass

    def _write_loop(self) -> None:
        while True:
            ids, then = self._queue.get()
            try:
                for node_id in ids:
                    self._write_queued(node_id)
                if then is not None and not self.failed:
                    then()
            except Exception as err:  # noqa: BLE001 - the writer thread must never die
                self.failed = str(err) or type(err).__name__
            finally:
                self._queue.task_done()

    def _write_queued(self, node_id: int) -> None:
        with self._lock:
            obj = self._pending.get(node_id)
        if obj is None:
            return  # deleted since, or written by an earlier batch (a later write)
        if self.failed:
            self.lost.add(node_id)
        else:
            self._write_file(node_id, obj)
        with self._lock:
            if self._pending.get(node_id) is obj:
                del self._pending[node_id]

    def _write_file(self, node_id: int, obj: Any) -> None:
        final = self.path(node_id)
        tmp = final.with_suffix(".tmp")
        try:
            data = encode(obj)
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                durable.sync_file(f.fileno())
            durable.replace(tmp, final)
        except Exception as err:  # noqa: BLE001 - the writer thread must never die
            self.failed = str(err) or type(err).__name__
            self.lost.add(node_id)
            try:
                tmp.unlink()
            except OSError:
                pass


def _read_file(path: Path) -> tuple[Any, str]:
    try:
        return decode(path.read_bytes()), ""
    except FileNotFoundError:
        return None, "file missing"
    except Exception as err:  # noqa: BLE001 - any unreadable file is a miss
        return None, str(err) or type(err).__name__


def take_over(lock: Path, plan: tuple[str, int] | None, patience: float = 10.0) -> int:
    """The tier's lock, for a rank of chat `plan[0]`'s plan generation `plan[1]`. A rank
    of an older generation of the same chat that still holds it (its host went away and
    came back with it running: a plan it must never be used with again) is stopped;
    anyone else's lock stays theirs (LockHeld)."""
    info = {"what": "disk tier"}
    if plan is not None:
        info.update(chat=plan[0], generation=plan[1])
    deadline = time.monotonic() + patience
    while True:
        try:
            return hold(lock, info)
        except LockHeld as held:
            older = (
                plan is not None
                and held.info.get("chat") == plan[0]
                and isinstance(held.info.get("generation"), int)
                and held.info["generation"] < plan[1]
                and held.pid is not None
                and held.pid != os.getpid()
            )
            if not older or time.monotonic() > deadline:
                raise
            try:
                os.kill(held.pid, signal.SIGKILL)  # type: ignore[arg-type]
            except OSError:
                pass  # gone already: its lock goes with it
            time.sleep(0.1)


def _in_use(folder: Path) -> bool:
    """Whether a running chat holds `folder`'s lock."""
    try:
        fd = hold(folder / "lock", {"what": "disk tier (checked)"})
    except LockHeld:
        return True
    except OSError:
        return False  # no lock file: nobody's
    os.close(fd)
    return False


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass  # gone already, or an orphan the next start removes


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def free_bytes(path: Path) -> int:
    """Free bytes on the file system holding `path` (its nearest existing parent)."""
    p = path
    while not p.exists() and p.parent != p:
        p = p.parent
    st = os.statvfs(p)
    return st.f_bavail * st.f_frsize
