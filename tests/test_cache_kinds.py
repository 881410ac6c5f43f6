"""Every cache kind in one radix tree: sliding-window (RotatingKVCache), linear
attention (ArraysCache states), MLA (deepseek_v3) and --max-kv-size, on tiny
in-memory models of mlx-lm's own families.

What a fetch gives is compared with a cold prefill of the same prefix in one chunk:
each stored token's K/V, a rotating cache's kept positions, a state's arrays, and
the logits of running on from there.
"""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mlx_lm.models.cache import make_prompt_cache

from exokv.cache import kinds, spans
from exokv.cache.kinds import KV, STATE
from exokv.cache.prefix_cache import PrefixCache
from tests.conftest import build_tiny_qwen
from tests.families import VOCAB, build

ATOL = 2e-4

# name -> (family or "qwen2", max_kv_size): one model per storage mix.
KINDS = {
    "window": ("gemma3_text", None),  # 5 sliding (window 16, keep 0) + 1 full attention
    "window-keep": ("qwen2", 24),  # --max-kv-size: every layer rotating, 4 tokens kept
    "state": ("qwen3_next", None),  # 3 linear-attention states + 1 full attention
    "mla": ("deepseek_v3", None),  # KVCache of per-head K and V
    "mixed-moe": ("gpt_oss", None),  # sliding and full attention alternating
    "composite": ("baichuan_m1", None),  # CacheList(conv state, sliding or full K/V)
}
_models: dict[str, object] = {}


def model_for(kind: str):
    family, max_kv = KINDS[kind]
    if family not in _models:
        _models[family] = build_tiny_qwen(vocab_size=VOCAB) if family == "qwen2" else build(family)
    model = _models[family]
    return model, (lambda: make_prompt_cache(model, max_kv_size=max_kv))


def toks(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(n)]


def run(model, cache, tokens) -> mx.array:
    out = model(mx.array([tokens]), cache=cache)[0]
    mx.eval(out, [kinds.arrays(c.state) for c in cache])
    return out


def cold(model, make_cache, tokens):
    cache = make_cache()
    if tokens:
        run(model, cache, tokens)
    return cache


def leaf_arrays(cache, leaf) -> list[np.ndarray]:
    """What a layer holds that decides what comes next, in a comparable form."""
    c = kinds.get(cache, leaf)
    if leaf.cls == KV:
        if c.keys is None:
            return []
        return [np.array(a[:, :, : c.offset, :]) for a in (c.keys, c.values)]
    if leaf.cls == STATE:
        return [np.array(a) for a in kinds.arrays(c.state)]
    kv, held = kinds.window_positions(c)
    if kv is None:
        return []
    need = spans.window_needs(int(c.offset), *leaf.cls[1:])
    out = []
    for a, b in need:
        out += [np.array(x) for x in kinds.window_slice(kv, held, a, b)]
    return out


def assert_same_cache(got, want, pc: PrefixCache) -> None:
    for leaf in pc.leaves:
        x, y = leaf_arrays(got, leaf), leaf_arrays(want, leaf)
        assert len(x) == len(y), leaf
        for a, b in zip(x, y, strict=True):
            assert a.shape == b.shape, (leaf, a.shape, b.shape)
            np.testing.assert_allclose(a, b, atol=ATOL, rtol=0)


def stored_bytes(pc: PrefixCache) -> int:
    """Every array the tree holds, counted from the arrays themselves."""
    total = 0
    for n in pc.tree.nodes():
        p = n.payload
        total += kinds.nbytes([p.kv, p.windows, [kinds.arrays(s.state) for s in p.states]])
    return total


@pytest.mark.parametrize("kind", list(KINDS))
def test_storage_classes_come_from_the_models_own_caches(kind):
    model, make_cache = model_for(kind)
    pc = PrefixCache(make_cache)
    expected = {
        "window": [KV, ("window", 16, 0)],
        "window-keep": [("window", 24, 4)],
        "state": [KV, STATE],
        "mla": [KV],
        "mixed-moe": [KV, ("window", 16, 0)],
        "composite": [KV, STATE, ("window", 16, 0)],
    }[kind]
    assert pc.classes == expected


@pytest.mark.parametrize("kind", list(KINDS))
def test_turns_reuse_the_tree_and_equal_a_cold_prefill(kind):
    """A linear chat and a branch: hits where the layers allow, each equal to cold."""
    model, make_cache = model_for(kind)
    pc = PrefixCache(make_cache)
    a = toks(40, 1)
    pc.insert(a, cold(model, make_cache, a))
    b = a + toks(7, 2)
    hit = pc.fetch(b)
    assert hit.length == 40  # a turn's end is always a usable point
    assert_same_cache(hit.cache, cold(model, make_cache, a), pc)
    got = run(model, hit.cache, b[40:])
    pc.release(hit)
    want = run(model, cold(model, make_cache, a), b[40:])
    assert mx.allclose(got, want, atol=ATOL, rtol=0).item()
    # A branch at 25, stored as the engine stores it: a point where it leaves the tree.
    c = a[:25] + toks(9, 3)
    hit = pc.fetch(c)
    expect = 25 if kind == "mla" else 0  # mid-edge: only full attention can cut anywhere
    assert hit.length == expect
    pc.release(hit)
    live = cold(model, make_cache, c[:25])
    pc.insert(c, live, length=25)
    run(model, live, c[25:])
    pc.insert(c, live)
    hit = pc.fetch(a[:25] + toks(4, 4))
    assert hit.length == 25
    assert_same_cache(hit.cache, cold(model, make_cache, a[:25]), pc)
    pc.release(hit)
    pc.tree.check()
    assert pc.total_bytes == stored_bytes(pc)


def test_window_layers_keep_only_what_a_node_end_can_need():
    model, make_cache = model_for("window")
    pc = PrefixCache(make_cache)
    w = ("window", 16, 0)
    a = toks(60, 5)
    (node,), _ = pc.insert(a, cold(model, make_cache, a))
    assert node.payload.spans[w] == [(44, 60)]  # the last window only
    counts = pc.counts(node)
    assert counts == {KV: 60, w: 16}
    rates = kinds.measure_rates(make_cache, lambda c: run(model, c, [1]))
    assert pc.total_bytes == stored_bytes(pc) == 60 * rates[KV] + 16 * rates[w]


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    kind=st.sampled_from(list(KINDS)),
    ops=st.lists(
        st.tuples(
            st.sampled_from(["insert", "insert", "fetch", "evict"]),
            st.lists(st.integers(0, 2), min_size=2, max_size=40),  # collide: splits
            st.integers(1, 39),  # where the engine's run pauses to store a point
        ),
        min_size=1,
        max_size=7,
    ),
)
def test_random_operations_fetch_what_a_cold_prefill_builds(kind, ops):
    """Random inserts (some paused mid-run, as the engine does where a prompt leaves
    the tree), fetches and evictions: every fetch equals a cold one-chunk prefill of
    its prefix, and running on from it gives the same logits; the byte counts stay exact.

    Under --max-kv-size ("window-keep") mlx-lm's rotating cache gives other K/V for
    other chunkings (its 4 kept tokens stay visible to the first token of each chunk),
    so there every insert is one chunk, as the cold prefill it is compared with."""
    model, make_cache = model_for(kind)
    pc = PrefixCache(make_cache)
    for op, seq, pause in ops:
        if op == "insert":
            live = make_cache()
            if pause < len(seq) and kind != "window-keep":
                run(model, live, seq[:pause])
                pc.insert(seq, live, length=pause)
                run(model, live, seq[pause:])
            else:
                run(model, live, seq)
            pc.insert(seq, live)
        elif op == "fetch":
            hit = pc.fetch(seq)
            assert hit.length <= min(pc.tree.match(seq).length, len(seq) - 1)
            reference = cold(model, make_cache, seq[: hit.length])
            assert_same_cache(hit.cache, reference, pc)
            got = run(model, hit.cache, seq[hit.length :])
            want = run(model, reference, seq[hit.length :])
            assert mx.allclose(got, want, atol=ATOL, rtol=0).item()
            pc.release(hit)
        else:
            leaves = [n for n in pc.tree.nodes() if n.is_leaf]
            if leaves:
                pc.evict(min(leaves, key=lambda n: (n.last_used, n.id)))
        pc.tree.check()
        assert pc.total_bytes == stored_bytes(pc)
        recount = dict.fromkeys(pc.classes, 0)
        for n in pc.tree.nodes():
            for c, k in pc.counts(n).items():
                recount[c] += k
        assert recount == pc.totals
