"""Bytes per cached token on an 8-conversation shared-prefix chat, per cache family.

Tiny in-memory models of mlx-lm's families (tests/families.py) with builtin:tiny's
tokenizer; each conversation is one turn: a long shared system prompt and its own
question. Prints the tokens the tree covers, the bytes our counters say it stores,
the MLX active memory it holds, and the tokens the turns took from the cache.

    EXOKV_HOME=$(mktemp -d) python benchmarks/cache_kinds.py
    # the code before a change: git archive <commit> | tar -x -C /tmp/old, then
    EXOKV_HOME=... PYTHONPATH=/tmp/old python benchmarks/cache_kinds.py
"""

import gc
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import mlx.core as mx  # noqa: E402
from families import build  # noqa: E402
from mlx.utils import tree_flatten, tree_unflatten  # noqa: E402

import exokv  # noqa: E402
from exokv.core.records import TurnRequest  # noqa: E402
from exokv.model.resolve import load_model  # noqa: E402
from exokv.rank.engine import Engine, EngineOptions  # noqa: E402

tok = load_model("builtin:tiny")[1]
SYSTEM = ("You answer briefly. " + " ".join(f"rule {i} is kept" for i in range(12))) * 8
Q = [
    "What is a river?",
    "Name a stone.",
    "Why is the sky blue?",
    "Count to three.",
    "Say hello.",
    "What is rain?",
    "Pick a colour.",
    "Who are you?",
]


def tiny_qwen():
    from mlx_lm.models import qwen2

    mx.random.seed(0)
    m = qwen2.Model(
        qwen2.ModelArgs(
            model_type="qwen2",
            hidden_size=64,
            num_hidden_layers=4,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            rms_norm_eps=1e-6,
            vocab_size=1024,
            tie_word_embeddings=True,
        )
    )
    m.update(
        tree_unflatten([(k, v * 3 if v.ndim == 2 else v) for k, v in tree_flatten(m.parameters())])
    )
    return m


print("exokv from", os.path.dirname(exokv.__file__))
for name, fam, mkv in [
    ("gemma3_text", "gemma3_text", None),
    ("gpt_oss", "gpt_oss", None),
    ("qwen3_next", "qwen3_next", None),
    ("deepseek_v3", "deepseek_v3", None),
    ("baichuan_m1", "baichuan_m1", None),
    ("--max-kv-size 256", "qwen2", 256),
]:
    model = tiny_qwen() if fam == "qwen2" else build(fam)
    try:
        e = Engine(model, tok, options=EngineOptions(max_kv_size=mkv))
    except Exception as err:
        print(f"{name:18s} Engine() fails: {type(err).__name__}: {err}")
        continue
    e.turn(TurnRequest("w", [{"role": "user", "content": "hi"}], max_tokens=4, use_cache=False))
    gc.collect()
    mx.clear_cache()
    before = mx.get_active_memory()
    cached = 0
    for i, q in enumerate(Q):
        r = e.turn(
            TurnRequest(
                f"s{i}",
                [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q * 6}],
                max_tokens=4,
            )
        )
        cached += r.cached_tokens
    gc.collect()
    mx.clear_cache()
    held = mx.get_active_memory() - before
    tokens = sum(len(n.key) for n in e.cache.tree.nodes())
    print(
        f"{name:18s} tree tokens {tokens:5d}  stored {e.cache.total_bytes:9d} B  "
        f"active {held:9d} B  bytes/token {held / tokens:8.1f}  "
        f"full-KV bytes/token {e.bytes_per_token}  cached tokens served {cached}"
    )
