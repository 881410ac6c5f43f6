"""A GGUF file as an mlx-lm model directory: config, tokenizer and MLX weights.

``mx.load`` reads GGUF natively: Q4_0, Q4_1 and Q8_0 tensors come back as MLX
affine-quantized arrays (weight, scales, biases; groups of 32), so they stay
quantized; F32, F16 and BF16 come back as they are. The directory written here
is an ordinary mlx-lm checkpoint (one safetensors file per layer, so a pipeline
rank reads only its own), loaded by the same loader as any other model.

The config comes from the file's metadata through transformers' table of GGUF
keys, the tokenizer through transformers' GGUF tokenizer builders (the parts
that need no torch), and the chat template from the metadata as it is.
"""

from __future__ import annotations

import contextlib
import re
import struct
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from exokv.errors import ExokvError

GGUF_MAGIC = b"GGUF"
# GGUF architecture -> mlx-lm model_type.
FAMILIES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3_text"}
GROUP_SIZE = 32
# GGUF types kept as they are: floats, and what mx.load gives as MLX quantized arrays.
FLOAT_TYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}
NATIVE_TYPES = {"F32": 32, "F16": 16, "BF16": 16, "Q4_0": 4, "Q4_1": 4, "Q8_0": 8}
# Types mx.load reads only by casting to float16 (its Q4_K decoding disagrees with
# llama.cpp's): decoded by the gguf package like the ones it cannot read.
MLX_CASTS = ("Q2_K", "Q4_K", "Q6_K")
# Types decoded by the gguf package and quantized again, at about their bits per weight.
REQUANTIZED = {
    "Q5_0": 5, "Q5_1": 5, "Q2_K": 3, "Q3_K": 4, "Q4_K": 4, "Q5_K": 5, "Q6_K": 6,
    "IQ4_NL": 4, "IQ4_XS": 4, "IQ3_XXS": 4, "IQ3_S": 4, "IQ2_XXS": 3, "IQ2_XS": 3, "IQ2_S": 3,
}  # fmt: skip

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
# llama.cpp pre-tokenizers that isolate each digit before GPT-2's split (SmolLM's).
_DIGIT_SPLIT_PRE = ("smollm", "starcoder", "refact")


def is_gguf(path: Path) -> bool:
    """A regular file that starts with the GGUF magic (a .gguf, or an ollama blob)."""
    try:
        with open(path, "rb") as f:
            return path.is_file() and f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def read_gguf(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(tensors, metadata): tensors as mx arrays, quantized ones in MLX's affine format.

    Q4_0, Q4_1 and Q8_0 come from ``mx.load`` as MLX quantized arrays, exactly.
    Other quantized types (Q4_K, Q6_K, Q5_0, ...) are decoded by the ``gguf``
    package (llama.cpp's own reference decoders) and quantized again with MLX at
    the closest bit width: mlx reads some of them only by casting, some not at all.
    """
    import mlx.core as mx
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
    except Exception as e:  # noqa: BLE001 - a truncated or foreign file
        raise ExokvError(f"{path} is not a readable GGUF file: {_one_line(e)}") from e
    metadata = {key: field.contents() for key, field in reader.fields.items()}
    kinds = {t.name: t.tensor_type for t in reader.tensors}
    unsupported = sorted({k.name for k in kinds.values() if _bits_for(k.name) is None})
    if unsupported:
        raise ExokvError(
            f"{path}: GGUF tensor type {', '.join(unsupported)} is not supported; supported: "
            f"{', '.join(NATIVE_TYPES)} (kept as they are) and "
            f"{', '.join(REQUANTIZED)} (quantized again for MLX)"
        )
    loaded: dict[str, Any] = {}
    # mx.load refuses a file holding a type it cannot read at all (Q5_0, ...): then
    # every tensor is decoded, the kept types too.
    if all(k.name in NATIVE_TYPES or k.name in MLX_CASTS for k in kinds.values()):
        try:
            with _gguf_named(path) as named:
                loaded = mx.load(str(named))
        except Exception as e:  # noqa: BLE001 - mlx raises plain exceptions for bad files
            raise ExokvError(f"cannot read the GGUF file {path}: {_one_line(e)}") from e
    tensors: dict[str, Any] = {}
    for tensor in reader.tensors:
        name, kind = tensor.name, tensor.tensor_type.name
        if kind in NATIVE_TYPES and name in loaded:
            base = name.removesuffix(".weight")
            parts = [name] + [
                f"{base}.{p}" for p in ("scales", "biases") if name.endswith(".weight")
            ]
            tensors.update((key, loaded[key]) for key in parts if key in loaded)
        else:
            tensors.update(_decoded(tensor, kind))
    return tensors, metadata


@contextlib.contextmanager
def _gguf_named(path: Path) -> Iterator[Path]:
    """``path``, or a link to it ending in .gguf: mx.load picks the format by extension."""
    if path.suffix == ".gguf":
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="exokv-gguf-") as tmp:
        link = Path(tmp) / "model.gguf"
        link.symlink_to(path.resolve())
        yield link


def _decoded(tensor: Any, kind: str) -> dict[str, Any]:
    """One tensor decoded by the gguf package; quantized types quantized again for MLX."""
    import mlx.core as mx
    import numpy as np
    from gguf import quants

    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    values = np.asarray(quants.dequantize(tensor.data, tensor.tensor_type)).reshape(shape)
    if kind in FLOAT_TYPES:
        return {tensor.name: mx.array(values).astype(getattr(mx, FLOAT_TYPES[kind]))}
    array = mx.array(values.astype(np.float32)).astype(mx.float16)
    if array.ndim != 2 or shape[-1] % GROUP_SIZE:
        return {tensor.name: array}
    weight, scales, biases = mx.quantize(array, group_size=GROUP_SIZE, bits=_bits_for(kind))
    base = tensor.name.removesuffix(".weight")
    return {tensor.name: weight, f"{base}.scales": scales, f"{base}.biases": biases}


def _bits_for(kind: str) -> int | None:
    """MLX bits for a GGUF type: its own for the kept ones, the closest for the others."""
    if kind in FLOAT_TYPES:
        return 16
    return NATIVE_TYPES.get(kind) or REQUANTIZED.get(kind)


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__


def convert_gguf(src: Path, out: Path, on_start: Callable[[], None] | None = None) -> int:
    """Write the mlx-lm directory for GGUF ``src`` into ``out``; the parameter count.

    ``on_start`` runs once the file is known to be one exokv can convert.
    """
    from exokv.model import builtin

    arch = _text(gguf_header(src, ("general.architecture",)).get("general.architecture"))
    if arch not in FAMILIES:
        raise ExokvError(
            f"{src}: GGUF architecture {arch!r} is not supported; "
            f"supported: {', '.join(sorted(FAMILIES))}"
        )
    tensors, meta = read_gguf(src)
    if on_start is not None:
        on_start()
    config = gguf_config(arch, meta, tensors)
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
    _quiet_transformers()
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    config: dict[str, Any] = {"model_type": FAMILIES[arch]}
    for key, name in GGUF_CONFIG_MAPPING[arch].items():
        value = meta.get(f"{arch}.{key}")
        if name and value is not None:
            config[name] = _value(value)
    tokens = meta.get("tokenizer.ggml.tokens") or []
    config.setdefault("vocab_size", len(tokens))
    config.setdefault("num_key_value_heads", config["num_attention_heads"])
    head_dim = meta.get(f"{arch}.attention.key_length")
    if head_dim is not None:
        config["head_dim"] = _value(head_dim)
    config.setdefault("head_dim", config["hidden_size"] // config["num_attention_heads"])
    config.setdefault("max_position_embeddings", 32768)
    config.setdefault("rope_theta", 10000.0)
    config["tie_word_embeddings"] = "output.weight" not in tensors
    config["rope_scaling"] = _rope_scaling(arch, meta)
    for gguf_key, name in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id")):
        value = meta.get(f"tokenizer.ggml.{gguf_key}")
        if value is not None:
            config[name] = _value(value)
    pad = meta.get("tokenizer.ggml.padding_token_id")
    config["pad_token_id"] = _value(pad) if pad is not None else config.get("eos_token_id")
    if arch == "gemma3":
        config.update(_gemma3_fields(meta, config))
    if arch == "qwen2":
        # mlx-lm's qwen2 always has q/k/v biases; a file without them cannot be loaded.
        config["attention_bias"] = True
    return config


def _rope_scaling(arch: str, meta: dict[str, Any]) -> dict[str, Any] | None:
    kind = meta.get(f"{arch}.rope.scaling.type")
    if kind is None or _text(kind) == "none":
        return None
    factor = meta.get(f"{arch}.rope.scaling.factor")
    if _text(kind) != "linear" or factor is None:
        raise ExokvError(
            f"GGUF rope scaling {_text(kind)!r} is not supported (only linear); "
            "convert the original checkpoint with mlx_lm.convert instead"
        )
    return {"rope_type": "linear", "factor": float(_value(factor))}


def _gemma3_fields(meta: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """What llama.cpp fixes in code for Gemma 3 rather than storing in the file."""
    layers = config["num_hidden_layers"]
    pattern = meta.get("gemma3.attention.sliding_window_pattern")
    if pattern is None:
        every = 6
    elif isinstance(pattern, list) or getattr(pattern, "size", 1) > 1:
        # One flag per layer (true: sliding); the global layers mark the period.
        flags = [bool(f) for f in _value(pattern)]
        globals_ = [i for i, sliding in enumerate(flags) if not sliding]
        every = globals_[0] + 1 if globals_ else layers + 1
    else:
        every = int(_value(pattern))
    # Gemma 3 27B scales queries by its hidden size per head, the others by head_dim.
    heads = config["num_attention_heads"]
    scalar = config["hidden_size"] // heads if layers == 62 else config["head_dim"]
    swa_base = meta.get("gemma3.rope.freq_base_swa")
    return {
        "sliding_window_pattern": every,
        "query_pre_attn_scalar": scalar,
        "rope_local_base_freq": float(_value(swa_base)) if swa_base is not None else 10000.0,
    }


# --- weights ---------------------------------------------------------------------------


def mlx_weights(arch: str, config: dict[str, Any], tensors: dict[str, Any]) -> dict[str, Any]:
    """The file's tensors under mlx-lm's names, undoing what llama.cpp's converter did."""
    names = _GEMMA3_NAMES if arch == "gemma3" else _LAYER_NAMES
    weights: dict[str, Any] = {}
    for key, value in tensors.items():
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
    import mlx.core as mx

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


# --- tokenizer -------------------------------------------------------------------------


def write_tokenizer(arch: str, meta: dict[str, Any], out: Path) -> None:
    """tokenizer.json and tokenizer_config.json (with the chat template) from the metadata."""
    _quiet_transformers()
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        GGUF_TOKENIZER_MAPPING,
        convert_gguf_tokenizer,
    )

    from exokv.model import builtin

    fields = GGUF_TOKENIZER_MAPPING["tokenizer"]
    spec = {
        name: _value(meta[f"tokenizer.{key}"])
        for key, name in fields.items()
        if f"tokenizer.{key}" in meta
    }
    if "tokens" not in spec:
        raise ExokvError("the GGUF file has no tokenizer (no tokenizer.ggml.tokens)")
    try:
        backend, _ = convert_gguf_tokenizer(arch, spec)
    except ValueError as e:
        raise ExokvError(f"cannot build the GGUF file's tokenizer: {e}") from e
    if spec.get("pre_tokenizer_type") in _DIGIT_SPLIT_PRE:
        from tokenizers import pre_tokenizers

        # llama.cpp splits digits one by one for these; transformers' table has no entry.
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    backend.save(str(out / "tokenizer.json"))
    tokens = spec["tokens"]

    def token(field: str) -> str | None:
        index = spec.get(field)
        return tokens[index] if isinstance(index, int) and 0 <= index < len(tokens) else None

    add_bos = meta.get("tokenizer.ggml.add_bos_token")
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "unk_token": token("unk_token_id"),
        "pad_token": token("pad_token_id"),
        "add_bos_token": bool(_value(add_bos)) if add_bos is not None else False,
        "clean_up_tokenization_spaces": False,
    }
    template = meta.get("tokenizer.chat_template")
    if template is not None:
        tokenizer_config["chat_template"] = _text(template)
    builtin.write_json(out / "tokenizer_config.json", tokenizer_config)


def _quiet_transformers() -> None:
    """No advice about PyTorch on import: exokv uses only transformers' tokenizer parts."""
    import os

    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


def _value(value: Any) -> Any:
    """A metadata value as plain Python (mx.load gives numbers and arrays as mx.array)."""
    if hasattr(value, "tolist"):
        return value.tolist()
    return value


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) or value is None else str(_value(value))


# --- a quick look at a file ---------------------------------------------------------------

# GGUF metadata value types: fixed sizes (struct formats); 8 is a string, 9 an array.
_SCALARS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
_STRING, _ARRAY = 8, 9


def gguf_header(path: Path, wanted: tuple[str, ...]) -> dict[str, Any]:
    """The scalar metadata ``wanted`` (e.g. general.architecture), read without the tensors.

    For listings: the gguf package's reader parses every array of the file
    (a vocabulary of 150,000 strings) before giving one key. Stops once all are found.
    """
    try:
        return _read_header(path, wanted)
    except (struct.error, UnicodeDecodeError, ValueError, MemoryError, OverflowError) as e:
        raise ExokvError(f"{path} is not a readable GGUF file: {_one_line(e)}") from e


def _read_header(path: Path, wanted: tuple[str, ...]) -> dict[str, Any]:
    found: dict[str, Any] = {}
    with open(path, "rb") as f:

        def read(fmt: str) -> Any:
            size = struct.calcsize("<" + fmt)
            return struct.unpack("<" + fmt, f.read(size))[0]

        def skip(kind: int) -> Any:
            if kind == _STRING:
                return f.read(read("Q")).decode("utf-8", "replace")
            if kind == _ARRAY:
                inner, count = read("I"), read("Q")
                if inner in _SCALARS:
                    f.seek(count * struct.calcsize("<" + _SCALARS[inner]), 1)
                else:
                    for _ in range(count):
                        skip(inner)
                return None
            return read(_SCALARS[kind])

        if f.read(4) != GGUF_MAGIC:
            raise ExokvError(f"{path} is not a GGUF file")
        _version, _tensors, count = read("I"), read("Q"), read("Q")
        for _ in range(count):
            key = f.read(read("Q")).decode("utf-8", "replace")
            value = skip(read("I"))
            if key in wanted:
                found[key] = value
                if len(found) == len(wanted):
                    break
    return found
