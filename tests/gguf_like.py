"""Tiny checkpoints shaped like a GGUF's once mx.load has read it: every matrix
4-bit quantized with float16 scales, the tied token embedding 8-bit, the norms kept
in float32. So the hidden state leaves the embedding as float16 and is float32
after the first layer, as in SmolLM2-135M's Q4_1 file, in a model small enough for
a fast test.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map_with_path

from exokv.model import builtin, zoo

GROUP = 32  # the smallest group mx.quantize takes; the zoo's widths (64, 128) divide by it
EMBEDDING = {"group_size": GROUP, "bits": 8}


def gguf_like_config(model_type: str) -> dict[str, Any]:
    return {
        **zoo._COMMON,
        "model_type": model_type,
        "tie_word_embeddings": True,
        "bos_token_id": builtin.SPECIAL_TOKENS.index(builtin.PAD_TOKEN),
        "eos_token_id": builtin.SPECIAL_TOKENS.index(builtin.EOS_TOKEN),
    }


def write_gguf_like(out: Path, model_type: str) -> Path:
    """An mlx-lm directory for `model_type` (llama: exokv's generic pipeline; qwen2:
    mlx-lm's own), with the builtins' tokenizer."""
    from mlx_lm.utils import save_config, save_model

    config = gguf_like_config(model_type)
    model = zoo.build_model(config)
    model.load_weights(list(zoo.init_weights(config).items()))
    model.set_dtype(mx.float16)

    def which(path: str, module: nn.Module) -> bool | dict[str, int]:
        if path.endswith("embed_tokens"):
            return EMBEDDING
        return hasattr(module, "to_quantized")

    nn.quantize(model, group_size=GROUP, bits=4, class_predicate=which)
    model.update(
        tree_map_with_path(
            lambda k, v: v.astype(mx.float32) if k.endswith("norm.weight") else v,
            model.parameters(),
        )
    )
    out.mkdir(parents=True, exist_ok=True)
    save_model(out, model)
    config["quantization"] = {"group_size": GROUP, "bits": 4, "model.embed_tokens": EMBEDDING}
    save_config(config, out / "config.json")
    builtin.write_tokenizer(out)
    assert any(v.dtype == mx.float32 for _, v in tree_flatten(model.parameters()))
    return out
