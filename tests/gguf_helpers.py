"""Writing GGUF files from the zoo's tiny checkpoints, as llama.cpp's converter would.

Independent of exokv's reader: tensor names come from the gguf package's own
name map (Hugging Face -> GGUF), llama's Q/K rows are permuted for interleaved
RoPE and Gemma's norm scales stored as 1 + w, as ``convert_hf_to_gguf.py`` does.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

ARCHS = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3_text": "gemma3"}
# Tokens the builtins' tokenizer marks as special (control tokens in GGUF terms).
CONTROL = 3
NORMAL = 1


def _permute(rows: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's Q/K permutation (Hugging Face half-split RoPE -> interleaved pairs)."""
    shape = rows.shape
    return rows.reshape(heads, 2, shape[0] // heads // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def source_weights(src: Path) -> dict[str, np.ndarray]:
    import mlx.core as mx

    weights: dict[str, np.ndarray] = {}
    for f in sorted(src.glob("*.safetensors")):
        for key, value in mx.load(str(f)).items():
            weights[key] = np.array(value.astype(mx.float32))
    return weights


def write_gguf(src: Path, out: Path, qtype: str = "F32", base: bool = False) -> Path:
    """A GGUF file of the mlx-lm checkpoint ``src``; 2-D weights as ``qtype`` (F32, Q8_0, ...).

    ``base``: as a base model's file: no chat template, no chat tokens in the vocabulary
    (the special tokens renamed <s>, <unused0>, </s>), and add_bos_token true."""
    import gguf

    config = json.loads((src / "config.json").read_text())
    arch = ARCHS[config["model_type"]]
    model_arch = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    layers = config["num_hidden_layers"]
    names = gguf.get_tensor_name_map(model_arch, layers)
    writer = gguf.GGUFWriter(str(out), arch)
    _write_config(writer, config, arch)
    _write_tokenizer(writer, src, config, base)
    kind = gguf.GGMLQuantizationType[qtype]
    file_type = "ALL_F32" if qtype == "F32" else f"MOSTLY_{qtype}"
    writer.add_file_type(gguf.LlamaFileType[file_type])
    for key, value in source_weights(src).items():
        module, _, suffix = key.rpartition(".")
        name = names.get_name(module)
        assert name is not None, key
        if arch == "llama" and module.endswith(("q_proj", "k_proj")):
            heads = config["num_attention_heads"]
            if module.endswith("k_proj"):
                heads = config["num_key_value_heads"]
            value = _permute(value, heads)
        if arch == "gemma3" and module.endswith("norm"):
            value = value + 1
        tensor = f"{name}.{suffix}"
        if qtype != "F32" and value.ndim == 2:
            writer.add_tensor(tensor, gguf.quants.quantize(value, kind), raw_dtype=kind)
        else:
            writer.add_tensor(tensor, value.astype(np.float32))
    scaling = config.get("rope_scaling") or {}
    if scaling.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", _llama3_factors(config, scaling))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _llama3_factors(config: dict[str, Any], scaling: dict[str, Any]) -> np.ndarray:
    """What llama.cpp's converter stores for Llama 3's RoPE scaling: one factor per frequency."""
    import math

    dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    base, factor = config.get("rope_theta", 10000.0), scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    factors = []
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi * base ** (i / dim)
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def _write_config(writer: Any, config: dict[str, Any], arch: str) -> None:
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config.get("rope_theta", 10000.0))
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_vocab_size(config["vocab_size"])
    if arch == "gemma3":
        layers = config["num_hidden_layers"]
        every = config["sliding_window_pattern"]
        writer.add_sliding_window(config["sliding_window"])
        writer.add_sliding_window_pattern([(i + 1) % every != 0 for i in range(layers)])


BASE_NAMES = {"<|endoftext|>": "<s>", "<|im_start|>": "<unused0>", "<|im_end|>": "</s>"}


def _write_tokenizer(writer: Any, src: Path, config: dict[str, Any], base: bool = False) -> None:
    tok = json.loads((src / "tokenizer.json").read_text())
    tok_config = json.loads((src / "tokenizer_config.json").read_text())
    vocab: dict[str, int] = tok["model"]["vocab"]
    special = {t["id"]: t["content"] for t in tok["added_tokens"]}
    tokens = [""] * config["vocab_size"]
    for token, index in vocab.items():
        tokens[index] = token
    for index, token in special.items():
        tokens[index] = BASE_NAMES.get(token, token) if base else token
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([CONTROL if i in special else NORMAL for i in range(len(tokens))])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_pad_token_id(config["pad_token_id"])
    writer.add_add_bos_token(base)
    if not base:
        writer.add_chat_template(tok_config["chat_template"])
