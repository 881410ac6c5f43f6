"""GGUF files as models: each converted once into a cached mlx-lm directory.

The cache lives in the machine's models folder, keyed by the file's identity
(resolved path, size and modification time), so every layout the directory
form supports (-n, --split, --parallel) works unchanged, and each rank loads
only its own layers through the usual loader.
"""

from __future__ import annotations

import hashlib
import sys
import time
from pathlib import Path

from exokv.config import machine_models_dir
from exokv.errors import ExokvError

# Bump when the conversion changes, so cached directories are converted again.
CONVERT_VERSION = 2
CACHE = "gguf"


def converted_dir(gguf: Path) -> Path:
    """Where the conversion of ``gguf`` is kept: a name a person can read, and a key."""
    st = gguf.stat()
    key = f"{gguf.resolve()}\0{st.st_size}\0{st.st_mtime_ns}".encode()
    stem = gguf.name.removesuffix(".gguf")[:48] or "model"
    return machine_models_dir() / CACHE / f"{stem}-{hashlib.sha256(key).hexdigest()[:12]}"


def ensure_gguf_model(gguf: Path, label: str | None = None) -> Path:
    """The mlx-lm directory for GGUF file ``gguf``, converted on first use."""
    from exokv.model import builtin
    from exokv.model.gguf_convert import convert_gguf

    out_dir = converted_dir(gguf)
    name = label or str(gguf)

    def announce() -> None:
        print(f"exokv: converting {name} for mlx-lm (once)", file=sys.stderr, flush=True)

    def generate(out: Path) -> None:
        start = time.monotonic()
        params = convert_gguf(gguf, out, on_start=announce)
        builtin.write_json(out / "exokv_source.json", {"source": name, "gguf": str(gguf)})
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
