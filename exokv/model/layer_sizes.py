"""A model's bytes per layer, read from its safetensors headers without loading a weight.

A safetensors file starts with 8 bytes (little-endian: the header's length) and a
JSON header naming each tensor's dtype, shape and `data_offsets` [begin, end) in
the data that follows; a tensor's bytes are end - begin, whatever its dtype
(quantized weights are U32 with their `.scales` and `.biases` beside them, all
counted with the layer they belong to). A model on the hub that is not downloaded
yet is read the same way through `huggingface_hub.get_safetensors_metadata`,
which fetches only the headers. What placement needs besides (the KV bytes one
token adds to a layer) comes from config.json.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from exokv.core.options import KvQuant
from exokv.errors import ExokvError, one_line
from exokv.hosts.placement import ModelSizes
from exokv.model import hub
from exokv.model.hub import layer_of
from exokv.model.resolve import resolve_model

_HEADER_LIMIT = 100 * 1024 * 1024  # safetensors' own bound on a header
_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


class SizesUnknown(ExokvError):
    """The layers' sizes cannot be read (a shard missing here and no hub, no headers)."""


def read_header(path: Path) -> dict[str, int]:
    """Tensor name -> bytes, from one safetensors file's header."""
    try:
        with open(path, "rb") as fh:
            length = int.from_bytes(fh.read(8), "little")
            if not 0 < length <= _HEADER_LIMIT:
                raise ValueError(f"a header length of {length} bytes")
            header = json.loads(fh.read(length))
    except (OSError, ValueError) as err:
        raise SizesUnknown(
            f"cannot read the safetensors header of {path}: {one_line(err)}"
        ) from err
    if not isinstance(header, dict):
        raise SizesUnknown(f"{path} has no safetensors header")
    sizes = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = info["data_offsets"]
            sizes[name] = int(end) - int(begin)
        except (TypeError, KeyError, ValueError):
            raise SizesUnknown(f"{path}: tensor {name!r} has no data_offsets") from None
    return sizes


def sizes_of(
    tensors: Mapping[str, int], config: Mapping[str, Any], kv: KvQuant = KvQuant()
) -> ModelSizes:
    """Bytes per layer and outside the layers, and each layer's KV bytes per token."""
    cfg = _text_config(config)
    count = cfg.get("num_hidden_layers") or cfg.get("n_layer") or cfg.get("num_layers")
    found = [i for i in map(layer_of, tensors) if i is not None]
    if not isinstance(count, int) or count < 1:
        count = max(found) + 1 if found else 0
    if count < 1:
        raise SizesUnknown("the model's weights name no decoder layers")
    layers = [0] * count
    shared = 0
    for name, size in tensors.items():
        i = layer_of(name)
        if i is None:
            shared += size
        elif i < count:  # mlx-lm drops layers past the config's count (e.g. MTP heads)
            layers[i] += size
    return ModelSizes(layers, shared, [kv_bytes_per_token(cfg, kv)] * count)


def kv_bytes_per_token(config: Mapping[str, Any], kv: KvQuant = KvQuant()) -> int:
    """Keys and values one token adds to one attention layer: kv heads x head dim x 2 x
    dtype bytes (quantized: the packed bits plus a scale and a bias per group)."""
    cfg = _text_config(config)
    heads = cfg.get("num_attention_heads") or cfg.get("n_head") or 0
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or (cfg.get("hidden_size", 0) // heads if heads else 0)
    if not isinstance(kv_heads, int) or not isinstance(head_dim, int):
        return 0
    dtype = cfg.get("torch_dtype") or cfg.get("dtype") or "float16"
    width = _DTYPE_BYTES.get(str(dtype), 2)
    values = 2 * kv_heads * head_dim
    if kv.bits:
        groups = -(-values // kv.group_size)
        return values * kv.bits // 8 + groups * 2 * width
    return values * width


def local_sizes(path: Path, kv: KvQuant = KvQuant()) -> ModelSizes:
    """The sizes of the model in directory `path`: every weight file must be there."""
    config = _json(path / "config.json")
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise SizesUnknown(f"{index} has no weight_map")
        files = sorted({str(f) for f in weight_map.values()})
    else:
        files = sorted(f.name for f in path.glob("model*.safetensors"))
    if not files:
        raise SizesUnknown(f"no safetensors weights in {path}")
    missing = [f for f in files if not (path / f).is_file()]
    if missing:
        raise SizesUnknown(
            f"{len(missing)} of the model's {len(files)} weight files are not here "
            f"(e.g. {missing[0]})"
        )
    tensors: dict[str, int] = {}
    for f in files:
        tensors.update(read_header(path / f))
    return sizes_of(tensors, config, kv)


def hub_sizes(repo: str, revision: str | None = None, kv: KvQuant = KvQuant()) -> ModelSizes:
    """The sizes of a hub repo's model from its headers alone (a few small requests, once
    per commit: kept beside the repo's cache, so a later chat plans with the hub gone)."""
    tensors, config = _hub_headers(repo, revision)
    return sizes_of(tensors, config, kv)


def _hub_headers(repo: str, revision: str | None) -> tuple[dict[str, int], dict[str, Any]]:
    commit = hub.cached_commit(repo, revision)
    if commit is not None:
        try:
            kept = json.loads(hub.kept_path(repo, commit, "tensors").read_text())
            return {str(k): int(v) for k, v in kept["tensors"].items()}, dict(kept["config"])
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass  # not asked yet (or a torn file): the hub once more
    # deferred: huggingface_hub's hub calls (~0.2 s) only when asking it; read at call time
    from huggingface_hub import get_safetensors_metadata, hf_hub_download

    where = repo if revision is None else f"{repo}@{revision}"
    try:
        meta = get_safetensors_metadata(repo, revision=revision)
        config = _json(Path(hf_hub_download(repo, "config.json", revision=revision)))
    except SizesUnknown:
        raise
    except Exception as err:  # noqa: BLE001 - the hub's many errors: one line naming the repo
        raise SizesUnknown(
            f"cannot read the layer sizes of {where} from the hub: {one_line(err)}"[:300]
        ) from err
    tensors = {
        name: info.data_offsets[1] - info.data_offsets[0]
        for file in meta.files_metadata.values()
        for name, info in file.tensors.items()
    }
    commit = hub.cached_commit(repo, revision)  # the config's download named it
    if commit is not None:
        hub.keep(repo, commit, "tensors", {"tensors": tensors, "config": config})
    return tensors, config


def model_sizes(name: str, kv: KvQuant = KvQuant()) -> ModelSizes:
    """The sizes of `--model name`: read here when its files are here, else from the hub
    (a repo not downloaded yet, or only some of its shards on this machine)."""
    repo_id = hub.repo_of(name)
    if repo_id is None:
        return local_sizes(resolve_model(name), kv)
    repo, revision = repo_id
    snapshot = hub.cached_snapshot(repo, revision)
    if snapshot is not None:
        try:
            return local_sizes(snapshot, kv)
        except SizesUnknown:
            pass  # a partial snapshot: the hub has every header
    return hub_sizes(repo, revision, kv)


def _text_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """A vision-language config's text part over its top level (the decoder's numbers)."""
    text = config.get("text_config")
    return {**config, **text} if isinstance(text, dict) else dict(config)


def _json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise SizesUnknown(f"cannot read {path}: {one_line(err)}") from err
    if not isinstance(data, dict):
        raise SizesUnknown(f"{path} is not a JSON object")
    return data
