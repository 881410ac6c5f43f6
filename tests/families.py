"""Tiny in-memory models of the mlx-lm families whose caches are not all KVCache.

Built from mlx-lm's own classes with tiny configs; every 2-D weight is multiplied
by 3 so logits depend on the prompt (see conftest.build_tiny_qwen).
"""

from __future__ import annotations

import importlib
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

VOCAB = 1024  # builtin:tiny's tokenizer, so an Engine can drive these models

CONFIGS: dict[str, dict[str, Any]] = {
    # 5 sliding-window layers (window 16) and 1 full-attention layer.
    "gemma3_text": dict(
        model_type="gemma3_text",
        hidden_size=64,
        num_hidden_layers=6,
        intermediate_size=128,
        num_attention_heads=4,
        head_dim=16,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        sliding_window=16,
        sliding_window_pattern=3,
        query_pre_attn_scalar=16,
    ),
    # Alternating sliding (window 16) and full attention, a tiny mixture of experts.
    "gpt_oss": dict(
        model_type="gpt_oss",
        num_hidden_layers=4,
        num_local_experts=4,
        num_experts_per_tok=2,
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=64,
        head_dim=16,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=16,
        layer_types=["sliding_attention", "full_attention"] * 2,
    ),
    # Linear attention (conv + recurrent state) in 3 of 4 layers.
    "qwen3_next": dict(
        model_type="qwen3_next",
        hidden_size=64,
        num_hidden_layers=4,
        intermediate_size=128,
        num_attention_heads=4,
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        shared_expert_intermediate_size=64,
        mlp_only_layers=[],
        moe_intermediate_size=32,
        rms_norm_eps=1e-6,
        vocab_size=VOCAB,
        num_key_value_heads=2,
        rope_theta=10000.0,
        partial_rotary_factor=0.5,
        max_position_embeddings=4096,
        head_dim=16,
        full_attention_interval=4,
    ),
    # Multi-head latent attention (its cache is a KVCache of per-head K and V).
    "deepseek_v3": dict(
        model_type="deepseek_v3",
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=4,
        num_experts_per_tok=2,
        kv_lora_rank=32,
        q_lora_rank=32,
        qk_rope_head_dim=8,
        v_head_dim=16,
        qk_nope_head_dim=16,
        first_k_dense_replace=1,
    ),
    # Composite caches: every layer a CacheList(ArraysCache conv state, RotatingKVCache
    # of window 16 in the sliding layers or KVCache in the others).
    "baichuan_m1": dict(
        model_type="baichuan_m1",
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=10000.0,
        sliding_window=16,
        sliding_window_layers=[0, 2],
        conv_window=2,
        rms_norm_eps=1e-6,
    ),
}


def build(family: str) -> Any:
    module = importlib.import_module(f"mlx_lm.models.{family}")
    mx.random.seed(0)
    model = module.Model(module.ModelArgs.from_dict(CONFIGS[family]))
    scaled = [(k, _scaled(k, v)) for k, v in tree_flatten(model.parameters())]
    model.update(tree_unflatten(scaled))
    mx.eval(model.parameters())
    model.eval()
    return model


def _scaled(name: str, value: mx.array) -> mx.array:
    if name.endswith(("conv_k", "conv_v")):  # baichuan_m1 starts them at zero: K/V of 0
        return mx.random.normal(value.shape) * 0.5 + 0.5
    return value * 3 if value.ndim == 2 else value
