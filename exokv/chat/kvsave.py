"""Save and load one session's KV cache on one rank, never trusting what comes back.

A saved cache is one file per rank, ``EXOKV_HOME/caches/<session>/rank<R>.safetensors``,
written by mlx-lm's ``save_prompt_cache`` to a temporary file that is then renamed
(a crash leaves the old file or the new one, never half of one). Its metadata holds
the model id, the rank layout, the exact token sequence the cache holds and a
SHA-256 checksum over all of that and every array. A load checks the file parses,
the checksum, the model, the layout, the cache's shape against the running model,
and that the tokens are a prefix of the conversation being resumed. Anything off
is a `SavedCacheError` with a one-line reason: the caller warns and recomputes.

The functions here run on every rank alike (each with its own shard); the
front end only sees `CacheFileReport`s, which are plain JSON-able data.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from exokv.cache.radix import common_prefix

FORMAT = "exokv-kv-1"
_TOKENS_LIMIT = 10_000_000  # a sanity bound on a metadata token list


class SavedCacheError(Exception):
    """A saved cache that must not be used; the message is one line, for a warning."""


@dataclass
class CacheFileReport:
    """What one save or load did, on every rank (``bytes`` and ``paths`` are per rank)."""

    session: str
    tokens: int = 0  # tokens saved or loaded; 0 when nothing was
    bytes: list[int] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)
    seconds: float = 0.0
    warning: str | None = None  # a problem: the saved cache was not used
    skipped: str | None = None  # nothing to do, not a problem (no file, nothing cached)
    events: list[dict[str, Any]] = field(default_factory=list)  # CacheEvent dicts of a load

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CacheFileReport:
        names = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in data.items() if k in names})


@dataclass
class Loaded:
    """A verified shard, ready for `Engine.import_prefix` once every rank agrees."""

    tokens: list[int]
    cache: list[Any]
    nbytes: int
    save_id: str
    path: Path


# -- paths ------------------------------------------------------------------------


def session_slug(session: str) -> str:
    """A file name for a session: readable, and made unique by a hash."""
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", session).strip("._")[:48] or "session"
    digest = hashlib.sha256(session.encode()).hexdigest()[:10]
    return f"{safe}-{digest}"


def session_dir(session: str, home: Path | None = None) -> Path:
    """One directory per session under the saved-caches directory."""
    from exokv.state.store import caches_dir

    return caches_dir(home) / session_slug(session)


def shard_path(session: str, rank: int, home: Path | None = None) -> Path:
    return session_dir(session, home) / f"rank{rank}.safetensors"


# -- the checksum -----------------------------------------------------------------


def _array_bytes(a: Any) -> bytes:
    import mlx.core as mx

    flat = mx.contiguous(mx.flatten(a)) if a.ndim else mx.reshape(a, (1,))
    return bytes(memoryview(flat.view(mx.uint8)))


def checksum(meta: dict[str, str], cache: Sequence[Any]) -> str:
    """SHA-256 over the metadata (but the checksum itself), cache classes and every array."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    digest = hashlib.sha256()
    head = {k: v for k, v in meta.items() if k != "checksum"}
    digest.update(json.dumps(head, sort_keys=True).encode())
    for layer, c in enumerate(cache):
        digest.update(f"\0{layer}:{type(c).__name__}".encode())
        for key, value in tree_flatten(c.state):
            if isinstance(value, mx.array):
                shape = ",".join(str(d) for d in value.shape)
                digest.update(f"\0{key}:{value.dtype}:{shape}\0".encode())
                digest.update(_array_bytes(value))
            else:
                digest.update(f"\0{key}={value!r}".encode())
    return digest.hexdigest()


# -- one shard ---------------------------------------------------------------------


def save_shard(path: Path, tokens: Sequence[int], cache: list[Any], meta: dict[str, str]) -> int:
    """Write `cache` (holding exactly `tokens`) atomically; returns the file's size."""
    from mlx_lm.models.cache import save_prompt_cache

    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {**meta, "format": FORMAT, "tokens": json.dumps(list(tokens), separators=(",", ":"))}
    meta["length"] = str(len(tokens))
    meta["checksum"] = checksum(meta, cache)
    # mlx appends ".safetensors" to a name without it, so the temporary name keeps it.
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp.safetensors")
    try:
        try:
            save_prompt_cache(str(tmp), cache, meta)
        except RuntimeError as err:
            # mlx reports a failed write (a full disk, a read-only folder) as RuntimeError;
            # callers treat every OSError as "not saved, go on", and so must this be.
            raise OSError(f"{err}".strip() or "the KV cache file could not be written") from err
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    _fsync_dir(path.parent)
    return path.stat().st_size


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # not every filesystem lets a directory be synced
    finally:
        os.close(fd)


def load_shard(path: Path, expect: dict[str, str]) -> tuple[list[int], list[Any], dict[str, str]]:
    """Read and verify one shard: its integrity, then every `expect`ed metadata value."""
    from mlx_lm.models.cache import load_prompt_cache

    try:
        cache, meta = load_prompt_cache(str(path), return_metadata=True)
    except Exception as err:  # noqa: BLE001 - any failure to parse means "unreadable"
        text = " ".join(str(err).split())[:160]
        raise SavedCacheError(f"is unreadable ({text or type(err).__name__})") from err
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise SavedCacheError("is not an exokv saved cache")
    try:
        ok = meta.get("checksum") == checksum(meta, cache)
    except Exception as err:  # noqa: BLE001 - a malformed state is damage too
        raise SavedCacheError(f"is damaged ({type(err).__name__})") from err
    if not ok:
        raise SavedCacheError("is damaged (checksum mismatch)")
    for key, want in expect.items():
        if meta.get(key) != want:
            what = {"model": "model", "layout": "rank layout", "rank": "rank"}.get(key, key)
            raise SavedCacheError(f"was saved for {what} {meta.get(key)!r}, not {want!r}")
    try:
        tokens = json.loads(meta["tokens"])
        valid = (
            isinstance(tokens, list)
            and len(tokens) < _TOKENS_LIMIT
            and all(isinstance(t, int) and t >= 0 for t in tokens)
        )
    except (KeyError, ValueError):
        valid = False
    if not valid or str(len(tokens)) != meta.get("length"):
        raise SavedCacheError("has a malformed token list")
    return tokens, cache, meta


# -- a rank's side of save and load -------------------------------------------------


def _cache_length(cache: Sequence[Any]) -> int:
    from exokv.cache.prefix_cache import cache_length

    return cache_length(cache)


def _leaves(x: Any) -> list[Any]:
    return list(x) if isinstance(x, tuple | list) else [x]


def _check_shape(engine: Any, cache: list[Any], tokens: list[int]) -> int:
    """The cache fits the running model (layers, cache types, bytes per token); its bytes."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache

    fresh = make_prompt_cache(engine.model, max_kv_size=engine.options.max_kv_size)
    saved_types = [type(c).__name__ for c in cache]
    types = [type(c).__name__ for c in fresh]
    if len(saved_types) != len(types):
        raise SavedCacheError(f"has {len(saved_types)} layers, this model {len(types)}")
    if saved_types != types:
        theirs, ours = sorted(set(saved_types) - set(types)), sorted(set(types) - set(saved_types))
        raise SavedCacheError(
            f"holds {', '.join(theirs) or 'other'} layers where this model uses "
            f"{', '.join(ours) or 'others'} (saved with another --max-kv-size?)"
        )
    for saved, now in zip(cache, fresh, strict=True):
        for attr in ("max_size", "keep"):  # a rotating window must be the same window
            if getattr(saved, attr, None) != getattr(now, attr, None):
                raise SavedCacheError(
                    f"has a {attr} of {getattr(saved, attr, None)}, this chat "
                    f"{getattr(now, attr, None)} (saved with another --max-kv-size?)"
                )
    if _cache_length(cache) != len(tokens):
        raise SavedCacheError("holds a different number of tokens than its metadata says")
    if all(type(c) in (KVCache, QuantizedKVCache) for c in cache) and tokens:
        per_token = 0
        for c in cache:
            for a in _leaves(c.keys) + _leaves(c.values):
                if a.ndim != 4 or a.shape[2] < len(tokens):
                    raise SavedCacheError("has arrays of the wrong shape")
                per_token += a.nbytes // a.shape[2]
        if per_token != engine.bytes_per_token:
            raise SavedCacheError("does not fit this model (bytes per token differ)")
    arrays = tree_flatten([c.state for c in cache])
    return sum(a.nbytes for _, a in arrays if isinstance(a, mx.array))


def save_session(
    engine: Any,
    session: str,
    messages: list[dict[str, str]],
    model_id: str,
    *,
    rank: int = 0,
    layout: str = "1",
    save_id: str = "",
    home: Path | None = None,
) -> CacheFileReport:
    """Save this rank's shard of the cached prefix of `messages` (all ranks call it alike)."""
    start = time.perf_counter()
    tokens, cache = engine.export_prefix(engine.render(messages))
    report = CacheFileReport(session=session)
    if not tokens:
        report.skipped = "nothing of this conversation is in the cache"
        return report
    path = shard_path(session, rank, home)
    meta = {
        "model": model_id,
        "layout": layout,
        "rank": str(rank),
        "session": session,
        "save_id": save_id,
        "created": f"{time.time():.3f}",
    }
    size = save_shard(path, tokens, cache, meta)
    report.tokens = len(tokens)
    report.bytes = [size]
    report.paths = [str(path)]
    report.seconds = time.perf_counter() - start
    return report


def prepare_load(
    engine: Any,
    session: str,
    messages: list[dict[str, str]],
    model_id: str,
    *,
    rank: int = 0,
    layout: str = "1",
    home: Path | None = None,
) -> tuple[Loaded | None, CacheFileReport]:
    """Read and verify this rank's shard for resuming `messages`; nothing is inserted yet.

    Returns (None, report with `skipped` or `warning`) when it must not be used.
    """
    start = time.perf_counter()
    report = CacheFileReport(session=session)
    path = shard_path(session, rank, home)
    if not path.is_file():
        report.skipped = "no saved KV cache"
        return None, report
    try:
        tokens, cache, meta = load_shard(
            path, {"model": model_id, "layout": layout, "rank": str(rank)}
        )
        nbytes = _check_shape(engine, cache, tokens)
        current = engine.render(messages)
        keep = common_prefix(tokens, current)
        if keep < len(tokens):
            # The conversation changed after the save (/undo, /retry): keep the shared part.
            from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

            if keep == 0 or not can_trim_prompt_cache(cache):
                raise SavedCacheError("does not match the conversation's tokens")
            trim_prompt_cache(cache, len(tokens) - keep)
            nbytes = nbytes * keep // max(len(tokens), 1)
            tokens = tokens[:keep]
        if engine.budget is not None and nbytes > engine.budget:
            raise SavedCacheError("is larger than this rank's cache budget")
    except SavedCacheError as err:
        report.warning = f"saved KV cache of session {session!r} ({path}) {err}"
        return None, report
    report.tokens = len(tokens)
    report.bytes = [path.stat().st_size]
    report.paths = [str(path)]
    report.seconds = time.perf_counter() - start
    return Loaded(tokens, cache, nbytes, meta.get("save_id", ""), path), report


def commit_load(engine: Any, loaded: Loaded, session: str, report: CacheFileReport) -> None:
    """Insert a verified shard into the prefix cache (every rank, same tokens, same order)."""
    start = time.perf_counter()
    events = engine.import_prefix(loaded.tokens, loaded.cache, session)
    report.events = [e.to_dict() for e in events]
    report.seconds += time.perf_counter() - start
