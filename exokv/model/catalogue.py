"""The models catalogue: every model `--model` can name here, and `exokv models`' table.

Listing reads only what is on disk (configs, safetensors headers, GGUF headers,
the Hugging Face cache's index, ollama's manifests); it loads no weights and never
fails on one odd model.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

from mlx.utils import tree_flatten

from exokv.config import exokv_home
from exokv.core.sizes import format_size
from exokv.errors import ExokvError
from exokv.model import builtin, ollama, zoo
from exokv.model.families import describe
from exokv.model.gguf_convert import FAMILIES
from exokv.model.gguf_models import converted_models
from exokv.model.gguf_read import gguf_header
from exokv.model.hub import hf_cache_dir
from exokv.model.packaged import MODELS as PACKAGED
from exokv.model.resolve import BUILTIN_NAMES, BUILTIN_PREFIX, generated_marker
from exokv.model.wheel_gguf import WheelModel


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
    model_type = config.get("model_type")
    if not isinstance(model_type, str):
        return False
    try:
        # deferred: mlx-lm (2 s) only to list models; every chat imports this module
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


def _packaged_entry(model: WheelModel) -> dict[str, Any]:
    """A model fetched from the package index: listed before it is fetched, with its source."""
    path = model.converted()
    marker = builtin.read_marker(path, model.convert_version)
    config = _read_config(path) if marker is not None else None
    family = {"family": model.model_type, **_UNKNOWN_FAMILY}
    return {
        "name": model.name,
        "kind": "pypi",
        "path": str(path),
        "generated": marker is not None,
        "size_bytes": _dir_size(path) if marker is not None else None,
        "params": marker.get("params") if marker else model.params,
        "model_type": model.model_type,
        **(_family_fields(config) if config else family),
        "quantization": quantization_of(config) if config else model.quantization,
        "source": model.source,
    }


def _converted_gguf_entries() -> list[dict[str, Any]]:
    """Every GGUF file converted here (``--model file.gguf``, ``ollama:``), by its source file.

    ``name`` is a source file that still holds those bytes (what ``--model`` takes
    to use this conversion), else the converted directory itself; ``sources``
    lists every such file known (the same bytes at several paths share one
    conversion).
    """
    found = []
    for folder, marker, files in converted_models():
        config = _read_config(folder)
        if config is None:
            continue
        found.append(
            {
                "name": str(files[0]) if files else str(folder),
                "kind": "gguf",
                "path": str(folder),
                "generated": True,
                "size_bytes": _dir_size(folder),
                "params": marker.get("params"),
                "model_type": config.get("model_type"),
                **_family_fields(config),
                "quantization": quantization_of(config),
                "source": str(files[0]) if files else None,
                "sources": [str(f) for f in files],
            }
        )
    return found


def _ollama_entries() -> list[dict[str, Any]]:
    """Models pulled with ollama; family and quantization from the GGUF header."""
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
    from gguf import LlamaFileType  # deferred: gguf brings numpy (~0.2 s); few lists have one

    try:
        return LlamaFileType(int(file_type)).name.removeprefix("MOSTLY_")
    except (TypeError, ValueError):
        return None


def _family_fields(config: dict[str, Any]) -> dict[str, Any]:
    """family, cache_kind, pipeline, tensor (None where mlx-lm cannot build the model)."""
    try:
        return describe(config)
    except Exception:  # noqa: BLE001 - a listing never fails on one odd model
        return {"family": config.get("model_type"), **_UNKNOWN_FAMILY}


def _hf_models() -> list[dict[str, Any]]:
    try:
        # deferred: huggingface_hub's cache scan (~70 ms); every chat imports this module
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
            found.append({**entry, **_shards_held(Path(newest.snapshot_path))})
    return found


def _shards_held(path: Path) -> dict[str, int | None]:
    """How many of the index's weight files this host holds (a host fetches only its
    layers' shards); None without an index."""
    try:
        names = set(
            json.loads((path / "model.safetensors.index.json").read_text())["weight_map"].values()
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {"shards_held": None, "shards_total": None}
    held = sum(1 for n in names if (path / n).is_file())
    return {"shards_held": held, "shards_total": len(names)}


def list_models() -> list[dict[str, Any]]:
    """smollm2 and gemma3-270m, the builtins and the zoo, then local models:
    EXOKV_HOME/models/*, the HF cache, the GGUF files converted here and ollama's store.

    Each entry: name (what --model takes), kind (pypi|builtin|zoo|local|huggingface|
    gguf|ollama), path, generated (False for a model not fetched or generated yet),
    size_bytes (on disk; None until then), params, model_type, what its family
    supports: family, cache_kind (slices|snapshots|mixed), pipeline (mlx-lm|generic),
    tensor; quantization (e.g. '4-bit'; None for float weights) and source (where it
    comes from; None for local and generated models; a converted GGUF's source file).
    Hugging Face models add shards_held/shards_total: the index's weight files here
    (None without an index); converted GGUF files add sources (every file known to
    hold the converted bytes).
    """
    models: list[dict[str, Any]] = [_packaged_entry(m) for m in PACKAGED.values()]
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
    models.extend(_converted_gguf_entries())
    models.extend(_ollama_entries())
    return models


def _generated_entry(
    short: str, kind: str, path: Path, params: int, config: dict[str, Any]
) -> dict[str, Any]:
    generated = generated_marker(short) is not None
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
    return tree_flatten(params)


def models_table(found: list[dict[str, Any]]) -> Any:
    """`exokv models` as a rich table that fits 80 columns and never cuts a name."""
    # deferred: rich (~0.1 s) only for `exokv models`; every chat imports this module
    from rich import box
    from rich.table import Table

    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False, padding=(0, 1, 0, 0))
    table.add_column("name", no_wrap=True)
    for header in ("family", "cache", "pipeline", "tensor", "quant"):
        table.add_column(header, overflow="fold")
    table.add_column("size", justify="right", overflow="fold")
    for m in found:
        size = format_size(m["size_bytes"], "decimal") if m.get("size_bytes") else "-"
        tensor = {True: "yes", False: "no"}.get(m.get("tensor"), "?")
        table.add_row(
            # A converted GGUF's name is its file's path: its file name fits the table.
            Path(m["name"]).name if m.get("kind") == "gguf" else m["name"],
            m.get("family") or "?",
            m.get("cache_kind") or "?",
            m.get("pipeline") or "-",
            tensor,
            (m.get("quantization") or "-").split(",")[0],
            size,
        )
    return table


def main() -> int:
    """This host's list_models() as one JSON document: `exokv models --hosts` runs it on each."""
    print(json.dumps(list_models()))
    return 0
