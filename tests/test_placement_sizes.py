"""exokv.model.layer_sizes: a model's bytes per layer from its safetensors headers, with
no weight loaded, equal to what the loaded model holds."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from exokv.core.options import KvQuant
from exokv.model import layer_sizes
from exokv.model.hub import layer_of
from exokv.model.hub import repo_of as hub_repo
from exokv.model.layer_sizes import (
    SizesUnknown,
    kv_bytes_per_token,
    local_sizes,
    read_header,
    sizes_of,
)


@pytest.fixture
def tiny_dir(models_dir: Path) -> Path:
    return models_dir / "tiny"


def _loaded_sizes(model: Any, layers: int) -> tuple[list[int], int]:
    """Bytes per layer, and outside the layers, of a loaded model's parameters."""
    loaded = [0] * layers
    shared = 0
    for name, value in tree_flatten(model.parameters()):
        i = layer_of(name)
        if i is None:
            shared += value.nbytes
        else:
            loaded[i] += value.nbytes
    return loaded, shared


def test_tiny_layers_weigh_what_the_loaded_model_holds(tiny_dir: Path, tiny):
    sizes = local_sizes(tiny_dir)
    model, _ = tiny
    assert (sizes.layers, sizes.shared) == _loaded_sizes(model, 4)
    assert all(sizes.layers)
    # Every byte of the files' data is in one of them.
    data = sum(sum(read_header(f).values()) for f in tiny_dir.glob("*.safetensors"))
    assert sum(sizes.layers) + sizes.shared == data
    # The KV one token adds to a layer: 2 kv heads x head dim 16 x (K and V) x float32.
    assert sizes.kv_per_token == [2 * 16 * 2 * 4] * 4


def test_header_is_the_length_then_json(tmp_path: Path):
    path = tmp_path / "model.safetensors"
    mx.save_safetensors(
        str(path),
        {"model.layers.0.w": mx.zeros((3, 5), dtype=mx.float16), "lm_head.weight": mx.zeros((7,))},
    )
    assert read_header(path) == {"model.layers.0.w": 30, "lm_head.weight": 28}
    (tmp_path / "bad.safetensors").write_bytes(b"\xff" * 8 + b"{}")
    with pytest.raises(SizesUnknown, match="header"):
        read_header(tmp_path / "bad.safetensors")
    (tmp_path / "cut.safetensors").write_bytes((100).to_bytes(8, "little") + b'{"a": ')
    with pytest.raises(SizesUnknown):
        read_header(tmp_path / "cut.safetensors")


@pytest.mark.parametrize(
    ("name", "layer"),
    [
        ("model.layers.12.self_attn.q_proj.weight", 12),
        ("model.layers.3.mlp.down_proj.scales", 3),  # quantized: scales and biases count
        ("model.layers.3.mlp.down_proj.biases", 3),
        ("language_model.model.layers.7.mlp.gate_proj.weight", 7),
        ("backbone.layers.2.mixer.in_proj.weight", 2),
        ("transformer.h.5.attn.c_attn.weight", 5),
        ("transformer.blocks.1.ffn.experts.mlp.w1", 1),
        ("model.layers.0.block_sparse_moe.switch_mlp.up_proj.weight", 0),
        ("model.embed_tokens.weight", None),
        ("model.embed_tokens.scales", None),
        ("model.norm.weight", None),
        ("lm_head.weight", None),
    ],
)
def test_tensor_names_map_to_layers(name: str, layer: int | None):
    assert layer_of(name) == layer


def test_sizes_of_quantized_tensors_and_layers_past_the_count():
    tensors = {
        "model.embed_tokens.weight": 1000,
        "model.embed_tokens.scales": 100,
        "model.layers.0.mlp.weight": 400,
        "model.layers.0.mlp.scales": 40,
        "model.layers.0.mlp.biases": 40,
        "model.layers.1.mlp.weight": 400,
        "model.layers.2.mlp.weight": 999,  # an MTP layer mlx-lm drops (past the count)
        "model.norm.weight": 8,
    }
    config = {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64}
    sizes = sizes_of(tensors, config)
    assert sizes.layers == [480, 400] and sizes.shared == 1108


def test_kv_bytes_per_token_from_the_config():
    base = {"num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096}
    assert kv_bytes_per_token({**base, "torch_dtype": "bfloat16"}) == 8 * 128 * 2 * 2
    assert kv_bytes_per_token({**base, "head_dim": 64, "torch_dtype": "float32"}) == 8 * 64 * 2 * 4
    assert kv_bytes_per_token({"text_config": {**base, "torch_dtype": "float16"}}) == 4096
    # 8 bits: one byte a value plus a scale and a bias (2 bytes each) per group of 64.
    assert kv_bytes_per_token({**base, "torch_dtype": "float16"}, KvQuant(8, 64)) == 2048 + 32 * 4
    no_gqa = {"num_attention_heads": 4, "hidden_size": 64}
    assert kv_bytes_per_token(no_gqa) == 4 * 16 * 2 * 2


def test_a_missing_shard_or_no_weights_is_one_line(tiny_dir: Path, tmp_path: Path):
    partial = tmp_path / "partial"
    partial.mkdir()
    for f in tiny_dir.iterdir():
        if f.name != "model-00003-of-00005.safetensors":
            os.symlink(f, partial / f.name)
    with pytest.raises(SizesUnknown, match="1 of the model's 5 weight files are not here"):
        local_sizes(partial)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text(json.dumps({"num_hidden_layers": 2}))
    with pytest.raises(SizesUnknown, match="no safetensors"):
        local_sizes(empty)


def test_hub_repo_names():
    assert hub_repo("mlx-community/Qwen3-4B-4bit") == ("mlx-community/Qwen3-4B-4bit", None)
    assert hub_repo("org/name@main") == ("org/name", "main")
    assert hub_repo("builtin:tiny") is None and hub_repo("smollm2") is None
    assert hub_repo("ollama:llama3") is None and hub_repo("a/b/c") is None


def test_hub_sizes_from_the_hubs_metadata_equal_the_local_ones(tiny_dir: Path, monkeypatch):
    """The hub path reads huggingface_hub's metadata objects: given the ones the hub
    would build from these files' headers, it finds the same sizes as reading them."""
    import huggingface_hub
    from huggingface_hub.utils._safetensors import (
        SafetensorsFileMetadata,
        SafetensorsRepoMetadata,
        TensorInfo,
    )

    files = {}
    for f in sorted(tiny_dir.glob("*.safetensors")):
        header = json.loads(f.read_bytes()[8 : 8 + int.from_bytes(f.read_bytes()[:8], "little")])
        tensors = {
            k: TensorInfo(dtype=v["dtype"], shape=v["shape"], data_offsets=tuple(v["data_offsets"]))
            for k, v in header.items()
            if k != "__metadata__"
        }
        files[f.name] = SafetensorsFileMetadata(metadata={}, tensors=tensors)
    weight_map = {t: name for name, meta in files.items() for t in meta.tensors}
    asked = []

    def metadata(repo: str, *, revision: str | None = None, **_: object):
        asked.append((repo, revision))
        return SafetensorsRepoMetadata(None, True, weight_map, files)

    def download(repo: str, filename: str, *, revision: str | None = None, **_: object) -> str:
        assert filename == "config.json"
        return str(tiny_dir / "config.json")

    monkeypatch.setattr(huggingface_hub, "get_safetensors_metadata", metadata)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    assert layer_sizes.hub_sizes("org/tiny", "abc") == local_sizes(tiny_dir)
    assert asked == [("org/tiny", "abc")]

    def unreachable(repo: str, **_: object):
        raise OSError("Connection refused")

    monkeypatch.setattr(huggingface_hub, "get_safetensors_metadata", unreachable)
    with pytest.raises(SizesUnknown, match="org/tiny@abc from the hub: .*Connection refused"):
        layer_sizes.hub_sizes("org/tiny", "abc")


@pytest.mark.timeout(300)
def test_every_zoo_family_layers_weigh_what_mlx_lm_loads(tmp_path_factory):
    """Each family's checkpoint, read by its headers, against the model mlx-lm builds
    from it: the same bytes in every layer and outside them (mlx-lm's sanitize renames
    some tensors, but keeps each in its layer)."""
    from mlx_lm.utils import load_model
    from zoo_helpers import FAMILIES, zoo_models

    models = zoo_models(tmp_path_factory)
    for family in FAMILIES:
        path = models / f"{family}-tiny"
        sizes = local_sizes(path)
        model, _ = load_model(path, lazy=True)
        loaded, shared = _loaded_sizes(model, len(sizes.layers))
        assert sizes.layers == loaded, family
        assert sizes.shared == shared, family
