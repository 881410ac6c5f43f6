"""GGUF files as models: each converted once into a cached mlx-lm directory.

The cache lives in the machine's models folder, keyed by the file's content (the
sha256 of its bytes), so the same file at another path, under another name or as
an ollama blob uses the conversion already made; every layout the directory form
supports (-n, --split, --parallel) works unchanged, and each rank loads only its
own layers through the usual loader.

Why a full hash rather than a sample of the file: two fine-tunes of one base
quantized alike have the same size and the same header (names, shapes, types and
offsets), so only their weights tell them apart, and a sample could miss where
they differ. Reading a file costs about a second per GB here (hashlib's sha256),
against a minute and more per GB to convert it, and it is read once per path: the
digest is kept under ``gguf/.sources/`` with the path's size, modification time
and inode, and read again only when one of those changes. An ollama blob is named
by the sha256 of its bytes (ollama checks it when it pulls), so it is not read.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

from exokv.config import machine_models_dir
from exokv.core.sizes import format_size
from exokv.errors import ExokvError
from exokv.model import builtin
from exokv.model.gguf_convert import convert_gguf
from exokv.model.progress import StepProgress

# Bump when the conversion changes, so cached directories are converted again.
CONVERT_VERSION = 2
CACHE = "gguf"
SOURCES = ".sources"
SOURCE_FILE = "exokv_source.json"
# Hex digits of the content hash in a converted directory's name.
KEY_LEN = 16
_OLLAMA_BLOB = re.compile(r"^sha256-([0-9a-f]{64})$")
# A file this large gets a line before it is read to find its conversion.
_SAY_HASHING = 1 << 30


def cache_dir() -> Path:
    return machine_models_dir() / CACHE


def content_hash(gguf: Path) -> str:
    """The sha256 of the file's bytes: from an ollama blob's name, a record, or a read."""
    named = _OLLAMA_BLOB.match(gguf.name)
    if named and gguf.parent.name == "blobs":
        return named.group(1)
    st = gguf.stat()
    resolved = gguf.resolve()
    record = _record_path(resolved)
    stamp = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino}
    known = _read_json(record)
    if known is not None and all(known.get(k) == v for k, v in stamp.items()):
        if isinstance(known.get("sha256"), str):
            return known["sha256"]
    if st.st_size >= _SAY_HASHING:
        size = format_size(st.st_size, "decimal")
        print(f"exokv: reading {gguf} ({size}) to find its conversion (once per path)",
              file=sys.stderr, flush=True)  # fmt: skip
    digest = _sha256(resolved)
    _remember(record, {"path": str(resolved), **stamp, "sha256": digest})
    return digest


def converted_dir(gguf: Path) -> Path:
    """Where the conversion of ``gguf`` is kept: a name a person can read, and the key.

    The first conversion names the directory after its file; the same bytes under
    another name find it by the key alone.
    """
    key = content_hash(gguf)[:KEY_LEN]
    cache = cache_dir()
    if cache.is_dir():
        for found in sorted(cache.glob(f"*-{key}")):
            if found.is_dir() and (found / "config.json").is_file():
                return found
    stem = gguf.name.removesuffix(".gguf")[:48] or "model"
    return cache / f"{stem}-{key}"


def ensure_gguf_model(gguf: Path, label: str | None = None) -> Path:
    """The mlx-lm directory for GGUF file ``gguf``, converted on first use."""
    out_dir = converted_dir(gguf)
    name = label or str(gguf)

    def generate(out: Path) -> None:
        start = time.monotonic()
        with StepProgress("reading its tensors", f"reading {gguf.name}'s metadata") as shown:
            announce = lambda: shown.say(f"converting {name} for mlx-lm (once)")  # noqa: E731
            params = convert_gguf(gguf, out, on_start=announce, progress=shown)
        source = {"source": name, "gguf": str(gguf.resolve()), "sha256": content_hash(gguf)}
        builtin.write_json(out / SOURCE_FILE, source)
        builtin.write_marker(out, out_dir.name, CONVERT_VERSION, params)
        took = time.monotonic() - start
        print(f"exokv: converted in {took:.1f}s into {out_dir}", file=sys.stderr, flush=True)

    try:
        return builtin.ensure_generated(out_dir, CONVERT_VERSION, generate)
    except OSError as e:
        raise ExokvError(
            f"could not convert {name} under {out_dir.parent}: {e}; "
            "check that the models folder (EXOKV_MODELS) is writable and has free space"
        ) from e


def converted_models() -> list[tuple[Path, dict[str, Any], list[Path]]]:
    """Every complete conversion here: (directory, its marker, the GGUF files it is of).

    The files are those known to hold its bytes now (the one converted and any
    other path seen since, unchanged), the one converted first.
    """
    cache = cache_dir()
    if not cache.is_dir():
        return []
    by_key: dict[str, list[Path]] = {}
    for record in sorted((cache / SOURCES).glob("*.json")):
        known = _read_json(record)
        if known is None or not isinstance(known.get("sha256"), str):
            continue
        path = Path(str(known.get("path")))
        if _unchanged(path, known):
            by_key.setdefault(known["sha256"][:KEY_LEN], []).append(path)
    found = []
    for folder in sorted(cache.iterdir()):
        if folder.name.startswith(".") or not folder.is_dir():
            continue
        marker = builtin.read_marker(folder, CONVERT_VERSION)
        if marker is None:
            continue
        first = (_read_json(folder / SOURCE_FILE) or {}).get("gguf")
        files = by_key.get(folder.name.rpartition("-")[2], [])
        if isinstance(first, str) and Path(first).is_file():
            files = [Path(first), *(f for f in files if f != Path(first))]
        found.append((folder, marker, files))
    return found


def _unchanged(path: Path, known: dict[str, Any]) -> bool:
    try:
        st = path.stat()
    except OSError:
        return False
    return known.get("size") == st.st_size and known.get("mtime_ns") == st.st_mtime_ns


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def _record_path(resolved: Path) -> Path:
    name = hashlib.sha256(str(resolved).encode()).hexdigest()[:24]
    return cache_dir() / SOURCES / f"{name}.json"


def _remember(record: Path, data: dict[str, Any]) -> None:
    """Written whole under a temporary name, then renamed: a reader sees all or nothing."""
    try:
        record.parent.mkdir(parents=True, exist_ok=True)
        tmp = record.with_name(f".{record.name}.{os.getpid()}")
        tmp.write_text(json.dumps(data, sort_keys=True) + "\n", encoding="utf-8")
        os.replace(tmp, record)
    except OSError:
        pass  # a read-only models folder: the file is read again next time


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
