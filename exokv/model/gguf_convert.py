"""A GGUF file as an mlx-lm model directory: config, tokenizer and MLX weights.

The directory written here is an ordinary mlx-lm checkpoint (one safetensors
file per layer, so a pipeline rank reads only its own), loaded by the same
loader as any other model. The config comes from the file's metadata through
transformers' table of GGUF keys, plus what llama.cpp fixes in code; what
llama.cpp's converter changed in the weights is undone.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx

from exokv.errors import ExokvError
from exokv.model import builtin
from exokv.model.gguf_read import GROUP_SIZE, gguf_header, read_gguf, text, value_of
from exokv.model.gguf_tokenizer import quiet_transformers, write_tokenizer

# GGUF architecture -> mlx-lm model_type.
FAMILIES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3_text"}

_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")
# GGUF tensor name (after blk.N.) -> mlx-lm module path (after model.layers.N.).
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma 3 has four norms per layer; llama.cpp names the one before the MLP ffn_norm.
_GEMMA3_NAMES = {
    **_LAYER_NAMES,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_SUFFIXES = ("weight", "bias", "scales", "biases")
ROPE_FREQS = "rope_freqs.weight"
# ollama's multimodal GGUFs hold a vision tower and projector beside the text model.
_VISION = ("v.", "mm.")


def convert_gguf(
    src: Path,
    out: Path,
    on_start: Callable[[], None] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> int:
    """Write the mlx-lm directory for GGUF ``src`` into ``out``; the parameter count.

    ``on_start`` runs once the file is known to be one exokv can convert;
    ``progress(done, total)`` as its tensors are read (bytes of tensor data), the
    bulk of the time (exokv.model.progress shows it).
    """
    arch = text(gguf_header(src, ("general.architecture",)).get("general.architecture"))
    if arch not in FAMILIES:
        raise ExokvError(
            f"{src}: GGUF architecture {arch!r} is not supported; "
            f"supported: {', '.join(sorted(FAMILIES))}"
        )
    started = False

    def on_tensor(done: int, total: int) -> None:
        nonlocal started
        if not started and on_start is not None:
            on_start()
        started = True
        if progress is not None:
            progress(done, total)

    tensors, meta = read_gguf(src, on_tensor=on_tensor)
    try:
        config = gguf_config(arch, meta, tensors)
    except KeyError as e:
        raise ExokvError(f"{src}: the GGUF metadata gives no {e.args[0]} for this {arch}") from e
    weights = mlx_weights(arch, config, tensors)
    config.update(_quantization(weights))
    builtin.write_json(out / "config.json", config)
    builtin.write_generation_config(config, out)
    write_tokenizer(arch, meta, out)
    builtin.write_weights(weights, out)
    return _param_count(weights, config)


# --- config ----------------------------------------------------------------------------


def gguf_config(arch: str, meta: dict[str, Any], tensors: dict[str, Any]) -> dict[str, Any]:
    """The Hugging Face style config.json for an mlx-lm model of this file."""
    quiet_transformers()
    # deferred: transformers (1.5 s) only while converting; `exokv models` imports this
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    config: dict[str, Any] = {"model_type": FAMILIES[arch]}
    for key, name in GGUF_CONFIG_MAPPING[arch].items():
        value = meta.get(f"{arch}.{key}")
        if name and value is not None:
            config[name] = value_of(value)
    tokens = meta.get("tokenizer.ggml.tokens") or []
    config.setdefault("vocab_size", len(tokens))
    config.setdefault("num_key_value_heads", config["num_attention_heads"])
    head_dim = meta.get(f"{arch}.attention.key_length")
    if head_dim is not None:
        config["head_dim"] = value_of(head_dim)
    config.setdefault("head_dim", config["hidden_size"] // config["num_attention_heads"])
    config.setdefault("max_position_embeddings", 32768)
    config.setdefault("rope_theta", 10000.0)
    config["tie_word_embeddings"] = "output.weight" not in tensors
    config["rope_scaling"] = _rope_scaling(arch, meta)
    if ROPE_FREQS in tensors:
        config["rope_scaling"] = _llama3_rope(meta, config, tensors[ROPE_FREQS])
    bos = meta.get("tokenizer.ggml.bos_token_id")
    if bos is not None:
        config["bos_token_id"] = value_of(bos)
    ends = end_of_turn_ids(meta)
    if ends:
        # mlx-lm stops on every id listed here (its TokenizerWrapper's eos_token_ids).
        config["eos_token_id"] = ends[0] if len(ends) == 1 else ends
    pad = meta.get("tokenizer.ggml.padding_token_id")
    config["pad_token_id"] = value_of(pad) if pad is not None else (ends[0] if ends else None)
    if arch == "gemma3":
        config.update(_gemma3_fields(meta, config))
    if arch == "qwen2":
        # mlx-lm's qwen2 always has q/k/v biases; a file without them cannot be loaded.
        config["attention_bias"] = True
    return config


def end_of_turn_ids(meta: dict[str, Any]) -> list[int]:
    """EOS, then the end-of-turn and end-of-message tokens where the file names them."""
    ids: list[int] = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        value = meta.get(f"tokenizer.ggml.{key}")
        if value is not None and value_of(value) not in ids:
            ids.append(value_of(value))
    return ids


def _rope_scaling(arch: str, meta: dict[str, Any]) -> dict[str, Any] | None:
    kind = meta.get(f"{arch}.rope.scaling.type")
    if kind is None or text(kind) == "none":
        return None
    factor = meta.get(f"{arch}.rope.scaling.factor")
    if text(kind) != "linear" or factor is None:
        raise ExokvError(
            f"GGUF rope scaling {text(kind)!r} is not supported (only linear); "
            "convert the original checkpoint with mlx_lm.convert instead"
        )
    return {"rope_type": "linear", "factor": float(value_of(factor))}


def _llama3_rope(meta: dict[str, Any], config: dict[str, Any], stored: Any) -> dict[str, Any]:
    """Llama 3.1+'s RoPE scaling, from the per-frequency factors llama.cpp stores.

    The file keeps only the factors; mlx-lm wants the four numbers they come
    from. Llama 3.1-3.3 all use low 1, high 4 and 8,192 tokens, which leaves the
    factor (the largest one); the factors these give must be the file's.
    """
    import numpy as np  # deferred: numpy (~0.1 s) only while converting; every chat imports this

    factors = np.array(stored, dtype=np.float64)
    old = meta.get("llama.rope.scaling.original_context_length") or 8192
    scaling = {
        "rope_type": "llama3",
        "factor": float(factors.max()),
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": int(old),
    }
    dims = len(factors) * 2
    wavelens = 2 * np.pi * config["rope_theta"] ** (np.arange(0, dims, 2) / dims)
    smooth = (old / wavelens - 1.0) / (4.0 - 1.0)
    expected = np.where(
        wavelens < old / 4.0,
        1.0,
        np.where(
            wavelens > old, scaling["factor"], 1 / ((1 - smooth) / scaling["factor"] + smooth)
        ),
    )
    if not np.allclose(expected, factors, rtol=1e-3):
        raise ExokvError(
            "the GGUF file's rope_freqs are not Llama 3's RoPE scaling; "
            "convert the original checkpoint with mlx_lm.convert instead"
        )
    return scaling


def _gemma3_fields(meta: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """What llama.cpp fixes in code for Gemma 3 rather than storing in the file."""
    layers = config["num_hidden_layers"]
    pattern = meta.get("gemma3.attention.sliding_window_pattern")
    if pattern is None:
        every = 6
    elif isinstance(pattern, list) or getattr(pattern, "size", 1) > 1:
        # One flag per layer (true: sliding); the global layers mark the period.
        flags = [bool(f) for f in value_of(pattern)]
        globals_ = [i for i, sliding in enumerate(flags) if not sliding]
        every = globals_[0] + 1 if globals_ else layers + 1
    else:
        every = int(value_of(pattern))
    # Gemma 3 27B scales queries by its hidden size per head, the others by head_dim.
    heads = config["num_attention_heads"]
    scalar = config["hidden_size"] // heads if layers == 62 else config["head_dim"]
    swa_base = meta.get("gemma3.rope.freq_base_swa")
    return {
        "sliding_window_pattern": every,
        "query_pre_attn_scalar": scalar,
        "rope_local_base_freq": float(value_of(swa_base)) if swa_base is not None else 10000.0,
    }


# --- weights ---------------------------------------------------------------------------


def mlx_weights(arch: str, config: dict[str, Any], tensors: dict[str, Any]) -> dict[str, Any]:
    """The file's tensors under mlx-lm's names, undoing what llama.cpp's converter did."""
    names = _GEMMA3_NAMES if arch == "gemma3" else _LAYER_NAMES
    weights: dict[str, Any] = {}
    for key, value in tensors.items():
        if key == ROPE_FREQS or key.startswith(_VISION):
            continue  # in config.json's rope_scaling; a vision tower exokv does not run
        base, _, suffix = key.rpartition(".")
        if suffix not in _SUFFIXES:
            raise ExokvError(f"unexpected tensor {key!r} in the GGUF file")
        block = _BLOCK.match(base)
        if block:
            layer, part = block.groups()
            if part not in names:
                raise ExokvError(f"the GGUF tensor {key!r} has no place in mlx-lm's {arch} model")
            name = f"model.layers.{layer}.{names[part]}.{suffix}"
        elif base in _TOP_NAMES:
            name = f"{_TOP_NAMES[base]}.{suffix}"
        else:
            raise ExokvError(f"the GGUF tensor {key!r} has no place in mlx-lm's {arch} model")
        if arch == "llama" and block and block.group(2) in ("attn_q", "attn_k"):
            heads = config["num_attention_heads"]
            if block.group(2) == "attn_k":
                heads = config["num_key_value_heads"]
            value = _unpermute_rows(value, heads)
        if arch == "gemma3" and base.endswith("norm") and suffix == "weight":
            # llama.cpp stores Gemma's RMSNorm scale as 1 + w; mlx-lm adds the 1 itself.
            value = value - 1
        weights[name] = value
    return weights


def _unpermute_rows(value: Any, heads: int) -> Any:
    """Undo llama.cpp's Q/K row order (interleaved RoPE pairs) back to Hugging Face's.

    Rows are output features and quantization groups run along the input, so
    the same row order applies to a quantized weight, its scales and its biases.
    """
    rows = value.shape[0]
    half = rows // heads // 2
    order = mx.arange(rows).reshape(heads, half, 2).swapaxes(1, 2).reshape(rows)
    return value[order]


def _quantization(weights: dict[str, Any]) -> dict[str, Any]:
    """mlx-lm's quantization config: the common bits, and each module that differs."""
    bits = {}
    for key, value in weights.items():
        if key.endswith(".scales"):
            module = key[: -len(".scales")]
            columns = weights[f"{module}.weight"].shape[-1]
            bits[module] = columns * 32 // (value.shape[-1] * GROUP_SIZE)
    if not bits:
        return {}
    counts: dict[int, int] = {}
    for b in bits.values():
        counts[b] = counts.get(b, 0) + 1
    common = max(counts, key=lambda b: (counts[b], -b))
    quant: dict[str, Any] = {"group_size": GROUP_SIZE, "bits": common, "mode": "affine"}
    for module, b in sorted(bits.items()):
        if b != common:
            quant[module] = {"group_size": GROUP_SIZE, "bits": b}
    return {"quantization": quant, "quantization_config": quant}


def _param_count(weights: dict[str, Any], config: dict[str, Any]) -> int:
    quant = config.get("quantization") or {}
    total = 0
    for key, value in weights.items():
        if key.endswith((".scales", ".biases")) and f"{key.rpartition('.')[0]}.scales" in weights:
            continue
        module = key.rpartition(".")[0]
        if key.endswith(".weight") and f"{module}.scales" in weights:
            bits = (quant.get(module) or quant)["bits"]
            total += value.size * 32 // bits
        else:
            total += value.size
    return total
