"""benchmarks/kv_quality.py's two quantized paths on a tiny model with a head dimension
quantization fits (64): exokv's stored-and-fetched cache gives exactly the logits of
mlx-lm's QuantizedKVCache carried through the same segments, so the benchmark's
figures measure quantization, not the store."""

from __future__ import annotations

import random

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from benchmarks.kv_quality import compare, quantized_cache, run_carried, run_exokv
from exokv.core.options import KvQuant
from exokv.rank.engine import Engine, EngineOptions
from tests.conftest import build_tiny_qwen
from tests.test_cache_budget import tokenizer  # noqa: F401 (the fixture)

pytestmark = pytest.mark.slow  # starts ranks, servers or real models: see tests/conftest.py


@pytest.mark.parametrize("bits, group", [(8, 64), (4, 32)])
def test_stored_and_fetched_equals_mlx_lms_carried_quantized_cache(bits, group, tokenizer):  # noqa: F811
    model = build_tiny_qwen(hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                            num_hidden_layers=2, vocab_size=1024)  # fmt: skip
    rng = random.Random(bits)
    tokens = [rng.randrange(1024) for _ in range(130)]
    engine = Engine(model, tokenizer, options=EngineOptions(kv=KvQuant(bits, group)))
    ours = run_exokv(engine, tokens, 40)  # 4 segments: 3 fetched from the store
    assert engine.cache.tree.match(tokens).length == len(tokens)
    theirs = run_carried(model, quantized_cache(model, group, bits), tokens, 40)
    full = run_carried(model, lambda: make_prompt_cache(model), tokens, 40)
    assert ours.shape == (len(tokens), 1024)
    assert mx.array_equal(ours, theirs).item()
    # Quantization does change the logits (the comparison is not of two full caches).
    assert not mx.allclose(ours, full, atol=1e-4).item()
    figures = compare(full, ours, tokens)
    assert 0 < figures["agreement"] <= 1 and figures["kl"] > 0
    assert compare(full, full, tokens)["kl"] == pytest.approx(0, abs=1e-6)
