"""The model zoo: one tiny checkpoint per mlx-lm family, generated like the builtins.

`builtin:<name>-tiny` (e.g. `builtin:llama-tiny`, `builtin:gemma3-tiny`) is a
Hugging Face-style directory under ``EXOKV_HOME/models/<name>-tiny``: config.json,
the builtins' tokenizer and chat template, and hash-seeded float32 weights, loaded
through mlx-lm's own load path like any downloaded model. Each family is built
from mlx-lm's own ``ModelArgs``/``Model`` classes, so adding one is one entry in
``FAMILIES``: its model_type and the config fields that make it tiny.

Every family keeps 4 layers (so ``--split 3,1`` works) and a sliding window of 32
tokens where it has one, so a short test chat crosses it.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from exokv.config import exokv_home
from exokv.model import builtin

# Bump when the generated files change, so stale zoo dirs are regenerated.
ZOO_VERSION = 1
SUFFIX = "-tiny"
SLIDING_WINDOW = 32

# Fields every family shares; a family's entry overrides or adds to them.
_COMMON: dict[str, Any] = {
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "vocab_size": builtin.VOCAB_SIZE,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}
_MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64}

# name -> (model_type, the config fields that make it tiny). One line per family.
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "qwen3": ("qwen3", {}),
    "qwen3-moe": (
        "qwen3_moe",
        {**_MOE, "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True},
    ),
    # Global attention every third layer: layer 2 is global, 0, 1 and 3 slide.
    "gemma3": (
        "gemma3_text",
        {
            "sliding_window": SLIDING_WINDOW,
            "sliding_window_pattern": 3,
            "query_pre_attn_scalar": 16,
        },
    ),
    "gpt-oss": (
        "gpt_oss",
        {
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "intermediate_size": 64,
            "sliding_window": SLIDING_WINDOW,
            "layer_types": ["sliding_attention", "full_attention"] * 2,
        },
    ),
    "ministral3": (
        "ministral3",
        {
            "sliding_window": SLIDING_WINDOW,
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention"]
            + ["sliding_attention"],
            "rope_parameters": {
                "rope_theta": 10000.0,
                "llama_4_scaling_beta": 0.1,
                "original_max_position_embeddings": 8192,
            },
        },
    ),
    # Multi-head latent attention and a mixture of experts after one dense layer.
    "deepseek-v3": (
        "deepseek_v3",
        {
            "n_routed_experts": 4,
            "n_shared_experts": 1,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
            "first_k_dense_replace": 1,
            "kv_lora_rank": 32,
            "q_lora_rank": 32,
            "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 16,
            "v_head_dim": 16,
            "n_group": 1,
            "topk_group": 1,
        },
    ),
    # Linear-attention (gated delta net) layers with full attention every second one.
    "qwen3-next": (
        "qwen3_next",
        {
            **_MOE,
            "linear_num_value_heads": 4,
            "linear_num_key_heads": 2,
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 16,
            "linear_conv_kernel_dim": 4,
            "decoder_sparse_step": 1,
            "shared_expert_intermediate_size": 64,
            "mlp_only_layers": [],
            "partial_rotary_factor": 0.25,
            "full_attention_interval": 2,
        },
    ),
}


def zoo_names() -> list[str]:
    """What --model takes after ``builtin:``, e.g. ``llama-tiny``."""
    return [name + SUFFIX for name in FAMILIES]


def family_of(short: str) -> str | None:
    """'llama-tiny' -> 'llama'; None if ``short`` is not a zoo name."""
    if short.endswith(SUFFIX) and short[: -len(SUFFIX)] in FAMILIES:
        return short[: -len(SUFFIX)]
    return None


def zoo_dir(short: str) -> Path:
    return exokv_home() / "models" / short


def zoo_config(short: str) -> dict[str, Any]:
    family = family_of(short)
    if family is None:
        raise KeyError(short)
    model_type, fields = FAMILIES[family]
    module = importlib.import_module(f"mlx_lm.models.{model_type}")
    config = {
        "architectures": [module.Model.__name__],
        "model_type": model_type,
        **_COMMON,
        **fields,
        "torch_dtype": "float32",
        "bos_token_id": builtin.SPECIAL_TOKENS.index(builtin.PAD_TOKEN),
        "eos_token_id": builtin.SPECIAL_TOKENS.index(builtin.EOS_TOKEN),
        "pad_token_id": builtin.SPECIAL_TOKENS.index(builtin.PAD_TOKEN),
        "exokv_builtin": {"name": short, "seed": builtin.SEED, "generator_version": ZOO_VERSION},
    }
    return config


def read_zoo_marker(short: str) -> dict[str, Any] | None:
    return builtin.read_marker(zoo_dir(short), ZOO_VERSION)


def ensure_zoo(short: str) -> Path:
    """Generate zoo model ``short`` (e.g. 'llama-tiny') once; return its directory."""
    if family_of(short) is None:
        raise KeyError(short)
    return builtin.ensure_generated(zoo_dir(short), ZOO_VERSION, lambda out: _generate(short, out))


def build_model(config: dict[str, Any]) -> Any:
    """mlx-lm's own Model for ``config``, with mlx's init (lazy: nothing is computed)."""
    from mlx_lm.utils import _get_classes  # deferred: mlx-lm (2 s); every chat imports this

    model_class, args_class = _get_classes(config)
    return model_class(args_class.from_dict(config))


def _generate(short: str, out: Path) -> None:
    config = zoo_config(short)
    builtin.write_json(out / "config.json", config)
    builtin.write_generation_config(config, out)
    builtin.write_tokenizer(out)
    weights = init_weights(config)
    builtin.write_weights(weights, out)
    params = sum(int(v.size) for v in weights.values())
    builtin.write_marker(out, short, ZOO_VERSION, params)


def init_weights(config: dict[str, Any]) -> dict[str, Any]:
    """Hash-seeded weights for every parameter of the family's own Model class.

    The builtins' rule, generalised: parameters that mlx-lm initialises to a
    constant (norm scales, attention sinks, routing biases) keep it; every matrix
    and stack of matrices is uniform with the builtins' x3 gain over its fan-in,
    so greedy replies depend on the prompt; other vectors get their fan-in bound.
    """
    # mlx-lm's init draws from the global random state; only its constants are used.
    params = dict(tree_flatten(build_model(config).parameters()))
    weights = {}
    for key in sorted(params):
        init = params[key].astype(mx.float32)
        shape = tuple(init.shape)
        if init.size and mx.all(init == init.reshape(-1)[0]).item():
            weights[key] = init
        elif key.endswith("embed_tokens.weight"):
            width = builtin.WEIGHT_GAIN * (3.0 / shape[-1]) ** 0.5
            weights[key] = builtin.uniform(shape, width, key)
        elif len(shape) >= 2 and shape[-1] > 1:
            weights[key] = builtin.uniform(shape, builtin.WEIGHT_GAIN * shape[-1] ** -0.5, key)
        else:
            fan_in = max(shape[-1] if len(shape) == 1 else 1, 1)
            sibling = params.get(key.rsplit(".", 1)[0] + ".weight")
            if sibling is not None and sibling.ndim >= 2:
                fan_in = sibling.shape[-1]
            weights[key] = builtin.uniform(shape, fan_in**-0.5, key)
    return weights
