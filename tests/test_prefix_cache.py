"""PrefixCache on a real (tiny, in-memory) qwen2: reuse must give the logits of a
cold prefill, never leak stored state, and hold a shared prefix once."""

from __future__ import annotations

import gc
import random

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx.utils import tree_flatten
from mlx_lm.models.cache import (
    KVCache,
    QuantizedKVCache,
    make_prompt_cache,
)

from exokv.cache.kinds import KV
from exokv.cache.prefix_cache import PrefixCache, cache_length

ATOL = 1e-4
VOCAB = 300


def toks(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(n)]


def prefill(model, cache, tokens) -> mx.array:
    """Run tokens through the model in one call; the logits of every position."""
    out = model(mx.array([tokens]), cache=cache)[0]
    mx.eval(out, [c.state for c in cache])
    return out


def cold(model, make_cache, tokens) -> mx.array:
    return prefill(model, make_cache(), tokens)


def warm(pc: PrefixCache, model, tokens, insert: bool = True):
    """One turn: fetch, prefill only the rest, release, insert. -> (hit length, rest logits)."""
    hit = pc.fetch(tokens)
    try:
        assert cache_length(hit.cache) == hit.length
        logits = prefill(model, hit.cache, tokens[hit.length :])
    finally:
        pc.release(hit)
    if insert:
        pc.insert(tokens, hit.cache)
    return hit.length, logits


def assert_same_as_cold(pc, model, make_cache, tokens, expect_hit=None, insert=True):
    length, logits = warm(pc, model, tokens, insert=insert)
    if expect_hit is not None:
        assert length == expect_hit
    reference = cold(model, make_cache, tokens)[length:]
    assert logits.shape == reference.shape
    assert mx.allclose(logits, reference, atol=ATOL, rtol=0).item(), float(
        mx.abs(logits - reference).max()
    )
    return length


def stored_arrays(pc: PrefixCache) -> dict:
    """A numpy copy of every array the tree holds, by node id."""
    return {
        n.id: [np.array(a) for a in payload_arrays(n.payload)]
        for n in pc.tree.nodes()
        if n.payload is not None
    }


def payload_arrays(p) -> list:
    return [
        a
        for _, a in tree_flatten([p.kv, p.windows, [s.state for s in p.states]])
        if isinstance(a, mx.array)
    ]


def assert_unchanged(before: dict, after: dict) -> None:
    assert before.keys() == after.keys()
    for node_id, arrays in before.items():
        assert len(arrays) == len(after[node_id])
        for a, b in zip(arrays, after[node_id], strict=True):
            np.testing.assert_array_equal(a, b)


def locked(pc: PrefixCache) -> list[int]:
    return [n.id for n in pc.tree.nodes() if n.locks]


def bytes_per_token(make_cache, model) -> int:
    """What one token adds to a cache of this kind, over all layers."""
    cache = make_cache()
    prefill(model, cache, [1])
    return sum(a[..., :1, :].nbytes for c in cache for _, a in tree_flatten((c.keys, c.values)))


@pytest.fixture
def kv(tiny_qwen):
    def make_cache():
        return make_prompt_cache(tiny_qwen)

    return tiny_qwen, make_cache, PrefixCache(make_cache)


# -- (a) reuse gives the logits of a cold prefill -------------------------------------


def test_kvcache_layers_are_stored_as_slices(kv):
    _, make_cache, pc = kv
    assert pc.classes == [KV] and pc.exact_anywhere
    assert all(type(c) is KVCache for c in make_cache())


def test_partial_mid_edge_and_split_hits_equal_cold_prefill(kv):
    model, make_cache, pc = kv
    a = toks(40, seed=1)
    assert assert_same_as_cold(pc, model, make_cache, a, expect_hit=0) == 0
    assert pc.total_bytes == 40 * bytes_per_token(make_cache, model)

    # Extends a whole stored entry: hit at the node boundary.
    b = a + toks(12, seed=2)
    assert_same_as_cold(pc, model, make_cache, b, expect_hit=40)

    # Diverges in the middle of the first edge: the hit ends mid-edge (fetched
    # before the insert, which then splits the 40-token edge at 25).
    n_nodes = len(list(pc.tree.nodes()))
    c = a[:25] + toks(10, seed=3)
    assert_same_as_cold(pc, model, make_cache, c, expect_hit=25)
    assert len(list(pc.tree.nodes())) == n_nodes + 2  # the new upper node + c's leaf
    assert [len(n.key) for n in pc.tree.match(a).path] == [25, 15]
    pc.tree.check()

    # After the split: a hit spanning the new upper node and part of the old lower one.
    d = a[:33] + toks(8, seed=4)
    assert_same_as_cold(pc, model, make_cache, d, expect_hit=33)

    # A hit across three edges (upper 25, lower 15, then part of b's 12-token leaf).
    e = b[:46] + toks(5, seed=5)
    assert_same_as_cold(pc, model, make_cache, e, expect_hit=46)

    # The whole stored prompt again: all but the last token comes from the cache.
    assert_same_as_cold(pc, model, make_cache, b, expect_hit=len(b) - 1)
    assert locked(pc) == []
    pc.tree.check()


def test_a_chat_with_greedy_decoding_matches_no_cache(kv):
    """Engine-shaped turns: prompt -> greedy reply -> insert prompt + reply; the
    next turn's prompt extends it. Replies and cached lengths match the baseline."""
    model, make_cache, pc = kv

    def reply(cache, tokens, n=6):
        logits = prefill(model, cache, tokens)[-1]
        out = [int(mx.argmax(logits))]
        while len(out) < n:  # like generate_step: the last token is never fed
            out.append(int(mx.argmax(prefill(model, cache, out[-1:])[-1])))
        return out

    history: list[int] = []
    for turn in range(4):
        prompt = history + toks(15, seed=100 + turn)
        baseline = reply(make_cache(), prompt)
        hit = pc.fetch(prompt)
        got = reply(hit.cache, prompt[hit.length :])
        pc.release(hit)
        assert got == baseline
        assert hit.length == (len(history) - 1 if turn else 0)
        pc.insert(prompt + got, hit.cache)  # the cache holds all but the last reply token
        history = prompt + got
    assert pc.tree.match(history).length == len(history) - 1


# -- (b) fetch never mutates what is stored ----------------------------------------


@pytest.mark.parametrize(
    "cut, expect",
    [(12, 12), (20, 20), (30, 29)],
    ids=["one-whole-edge", "two-edges-mid-edge", "whole-prompt"],
)
def test_fetch_never_mutates_stored_data(kv, cut, expect):
    model, make_cache, pc = kv
    a = toks(30, seed=10)
    warm(pc, model, a)
    warm(pc, model, a[:12] + toks(9, seed=11))  # a's path is now two edges: 12 + 18
    before = stored_arrays(pc)

    prompt = a[:cut] + toks(5, seed=12) if cut < len(a) else a
    first = pc.fetch(prompt)
    assert first.length == expect
    first_state = [np.array(x) for c in first.cache for x in (c.keys, c.values)]
    # Use the fetched cache hard. A trim first, so the next writes fit the buffers
    # the fetch returned and land in place; then a prefill and single-token decode
    # steps (in-place writes again), and another trim.
    for c in first.cache:
        c.trim(3)
    prefill(model, first.cache, [7, 8])
    prefill(model, first.cache, prompt[first.length - 1 :])
    for t in (3, 4, 5):
        prefill(model, first.cache, [t])
    first.cache[0].trim(7)
    pc.release(first)

    assert_unchanged(before, stored_arrays(pc))
    second = pc.fetch(prompt)
    assert second.length == first.length
    again = [np.array(x) for c in second.cache for x in (c.keys, c.values)]
    for x, y in zip(first_state, again, strict=True):
        np.testing.assert_array_equal(x, y)
    pc.release(second)


def test_two_fetches_are_independent(kv):
    model, make_cache, pc = kv
    a = toks(20, seed=13)
    warm(pc, model, a)
    h1, h2 = pc.fetch(a), pc.fetch(a)
    assert h1.cache is not h2.cache and h1.cache[0] is not h2.cache[0]
    assert pc.tree.find(1).locks == 2
    out1 = prefill(model, h1.cache, a[-1:] + [7, 8])
    out2 = prefill(model, h2.cache, a[-1:] + [7, 8])
    assert mx.array_equal(out1, out2).item()
    pc.release(h1)
    pc.release(h2)
    assert locked(pc) == []


# -- (c) never the whole prompt -------------------------------------------------------


def test_never_returns_the_whole_prompt_as_cached(kv):
    model, make_cache, pc = kv
    a = toks(24, seed=20)
    warm(pc, model, a)
    warm(pc, model, a[:10] + [1, 2, 3])
    for n in range(0, len(a) + 1):
        hit = pc.fetch(a[:n])
        assert hit.length == max(0, n - 1)
        assert cache_length(hit.cache) == hit.length
        for c in hit.cache:
            assert c.keys is None or c.keys.shape[2] == hit.length
        pc.release(hit)
    for prompt, expect in [(a[:10] + [1, 2, 3], 12), (a[:10] + [1, 2], 11), ([a[0]], 0)]:
        hit = pc.fetch(prompt)
        assert hit.length == expect
        pc.release(hit)
    assert locked(pc) == []


# -- (d) a shared prefix is held once --------------------------------------------------


def test_shared_prefix_is_stored_once_by_counters_and_by_memory(kv):
    model, make_cache, pc = kv
    prefix = toks(300, seed=30)
    suffixes = [toks(20, seed=31 + i) for i in range(4)]
    bpt = bytes_per_token(make_cache, model)  # 4 layers x (K+V) x 2 heads x 16 x 4 bytes
    assert bpt == 4 * 2 * 2 * 16 * 4
    single = (300 + 4 * 20) * bpt  # the prefix once plus four suffixes
    one_conversation = 320 * bpt

    gc.collect()
    base = mx.get_active_memory()
    for i, suffix in enumerate(suffixes):
        length, logits = warm(pc, model, prefix + suffix)
        assert length == (300 if i else 0)
        del logits
    gc.collect()  # the working caches are gone; only the tree holds K/V now
    grown = mx.get_active_memory() - base

    assert pc.total_bytes == single  # exact: nodes own exactly their edges
    assert sorted(len(n.key) for n in pc.tree.nodes()) == [20, 20, 20, 20, 300]
    # Tolerance: the stored arrays are exactly `single` bytes, so the only slack is
    # what the allocator adds (alignment/rounding of 32 buffers, a few hundred bytes
    # each at most) and stray small arrays. 1.3x absorbs that; a layout that kept the
    # 300-token prefix per conversation (or kept slices as views of the working
    # caches, which are 512-token buffers) needs >= 4 x 320 tokens = 3.4x `single`.
    assert grown <= 1.3 * single, (grown, single)
    assert grown < 0.5 * 4 * one_conversation


def test_memory_measurement_would_catch_slices_that_keep_buffers_alive(kv):
    """Control for the test above: views into working caches are not a single copy."""
    model, make_cache, _ = kv
    prefix = toks(300, seed=30)
    single = (300 + 4 * 20) * bytes_per_token(make_cache, model)
    gc.collect()
    base = mx.get_active_memory()
    views = []
    for i in range(4):
        cache = make_cache()
        prefill(model, cache, prefix + toks(20, seed=31 + i))
        views.append([(c.keys[:, :, 300:320, :], c.values[:, :, 300:320, :]) for c in cache])
        del cache
    gc.collect()
    assert mx.get_active_memory() - base > 3 * single


# -- (e) quantized caches -----------------------------------------------------------


def test_quantized_kvcache_slices_match_cold_quantized_run(tiny_qwen_hd32):
    model = tiny_qwen_hd32

    def make_cache():
        return [QuantizedKVCache(group_size=32, bits=8) for _ in model.layers]

    pc = PrefixCache(make_cache)
    assert pc.classes == [KV]
    a = toks(50, seed=40)
    assert_same_as_cold(pc, model, make_cache, a, expect_hit=0)
    assert_same_as_cold(pc, model, make_cache, a + toks(10, seed=41), expect_hit=50)
    assert_same_as_cold(pc, model, make_cache, a[:23] + toks(10, seed=42), expect_hit=23)
    assert_same_as_cold(pc, model, make_cache, a[:30] + toks(6, seed=43), expect_hit=30)
    bpt = bytes_per_token(make_cache, model)
    assert pc.total_bytes == (50 + 10 + 10 + 6) * bpt
    for n in pc.tree.nodes():
        assert n.payload.nbytes == len(n.key) * bpt
        (keys, values) = n.payload.kv[0]
        assert len(keys) == 3 and keys[0].dtype == mx.uint32  # (weights, scales, biases)
    hit = pc.fetch(a + [1])
    assert hit.length == 50 and all(isinstance(c, QuantizedKVCache) for c in hit.cache)
    assert all(c.keys[0].shape[2] == 50 and c.bits == 8 for c in hit.cache)
    pc.release(hit)


# -- (f) rotating caches: snapshots ----------------------------------------------------


def _run(model, make_cache, tokens, chunks=None):
    """A cache after running tokens, in the given chunk sizes (default: one call)."""
    cache = make_cache()
    pos = 0
    for n in chunks or [len(tokens)]:
        prefill(model, cache, tokens[pos : pos + n])
        pos += n
    assert pos == len(tokens)
    return cache


# -- (g) eviction ------------------------------------------------------------------


def test_evict_frees_bytes_and_memory(kv):
    model, make_cache, pc = kv
    bpt = bytes_per_token(make_cache, model)
    a = toks(200, seed=80)
    warm(pc, model, a)
    warm(pc, model, a[:50] + toks(100, seed=81))
    leaf = pc.tree.match(a).path[-1]
    assert len(leaf.key) == 150 and pc.entry_bytes(leaf) == 150 * bpt

    total = pc.total_bytes
    gc.collect()
    mem = mx.get_active_memory()
    freed = pc.evict(leaf)
    gc.collect()
    assert freed == 150 * bpt
    assert pc.total_bytes == total - freed
    assert mem - mx.get_active_memory() >= 0.9 * freed  # the buffers really went
    assert pc.tree.match(a).length == 50
    pc.tree.check()
    # What is left still gives exact reuse.
    assert_same_as_cold(pc, model, make_cache, a, expect_hit=50, insert=False)


def test_locked_path_cannot_be_evicted(kv):
    model, make_cache, pc = kv
    a = toks(30, seed=90)
    warm(pc, model, a)
    warm(pc, model, a[:10] + toks(5, seed=91))
    hit = pc.fetch(a + [1])
    leaf = hit.path[-1]
    upper = pc.tree.match(a).path[0]
    total = pc.total_bytes
    for node in (leaf, upper):  # the locked leaf, and its parent (not a leaf)
        with pytest.raises(ValueError):
            pc.evict(node)
    assert pc.total_bytes == total and leaf.payload is not None
    # An unrelated unlocked leaf can go meanwhile.
    other = pc.tree.match(a[:10] + toks(5, seed=91)).path[-1]
    pc.evict(other)
    assert pc.total_bytes == total - 5 * bytes_per_token(make_cache, model)
    pc.release(hit)
    pc.evict(leaf)
    pc.evict(upper)
    assert pc.total_bytes == 0 and list(pc.tree.nodes()) == []


# -- insert's report, clear -------------------------------------------------------


def test_insert_reports_new_heads_as_added_and_cut_nodes_as_split(kv):
    model, make_cache, pc = kv
    bpt = bytes_per_token(make_cache, model)
    a = toks(30, seed=100)
    (first,), split = pc.insert(a, _run(model, make_cache, a))
    assert split == [] and pc.entry_bytes(first) == 30 * bpt
    b = a[:12] + toks(4, seed=101)
    added, split = pc.insert(b, _run(model, make_cache, b))
    assert split == [first] and pc.entry_bytes(first) == 18 * bpt  # keeps the tail
    head, leaf = added
    assert (len(head.key), len(leaf.key)) == (12, 4)
    assert (pc.entry_bytes(head), pc.entry_bytes(leaf)) == (12 * bpt, 4 * bpt)
    assert pc.total_bytes == (30 + 4) * bpt


def test_clear_drops_everything_and_never_reuses_ids(kv):
    model, make_cache, pc = kv
    a = toks(40, seed=104)
    warm(pc, model, a)
    warm(pc, model, a[:20] + [1, 2])
    old_ids = {n.id for n in pc.tree.nodes()}
    gc.collect()
    mem = mx.get_active_memory()
    held = pc.total_bytes
    pc.clear()
    gc.collect()
    assert pc.total_bytes == 0 and list(pc.tree.nodes()) == []
    assert mem - mx.get_active_memory() >= 0.9 * held
    hit = pc.fetch(a)
    assert hit.length == 0
    pc.release(hit)
    warm(pc, model, a)
    new_ids = {n.id for n in pc.tree.nodes()}
    assert new_ids and min(new_ids) > max(old_ids)
    assert_same_as_cold(pc, model, make_cache, a + [3], expect_hit=40)


# -- random operations: fetched K/V is exactly the prefix's -----------------------


@settings(max_examples=25, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["insert", "insert", "fetch", "evict"]),
            st.lists(st.integers(0, 3), min_size=1, max_size=20),  # collide: splits
        ),
        min_size=1,
        max_size=8,
    )
)
def test_random_operations_fetch_the_prefix_kv(tiny_qwen, ops):
    model = tiny_qwen

    def make_cache():
        return make_prompt_cache(model)

    pc = PrefixCache(make_cache)
    bpt = bytes_per_token(make_cache, model)
    for op, seq in ops:
        if op == "insert":
            pc.insert(seq, _run(model, make_cache, seq))
        elif op == "fetch":
            hit = pc.fetch(seq)
            assert hit.length == min(pc.tree.match(seq).length, len(seq) - 1)
            if hit.length:
                reference = _run(model, make_cache, seq[: hit.length])
                for got, want in zip(hit.cache, reference, strict=True):
                    for x, y in ((got.keys, want.keys), (got.values, want.values)):
                        assert x.shape[2] == hit.length
                        assert mx.allclose(x, y[:, :, : hit.length], atol=ATOL, rtol=0).item()
            pc.release(hit)
        else:
            leaves = [n for n in pc.tree.nodes() if n.is_leaf]
            if leaves:
                victim = min(leaves, key=lambda n: (n.last_used, n.id))
                before = pc.total_bytes
                assert pc.evict(victim) == len(victim.key) * bpt
                assert pc.total_bytes == before - len(victim.key) * bpt
        pc.tree.check()
        assert locked(pc) == []
        assert pc.total_bytes == bpt * sum(len(n.key) for n in pc.tree.nodes())


def test_a_lent_hit_gives_the_same_kv_back_even_without_an_insert(kv):
    """fetch(lend=True) hands whole path nodes' K/V to the turn's cache (held once);
    release gives it back, copied from that cache, whatever the model wrote after it."""
    model, make_cache, pc = kv
    a = toks(60, seed=120)
    warm(pc, model, a)
    warm(pc, model, a + toks(20, seed=121))
    before = stored_arrays(pc)
    tokens = a + toks(20, seed=121) + toks(5, seed=122)
    hit = pc.fetch(tokens, expect=len(tokens) + 300, lend=True)
    assert hit.length == 80 and [n.depth for n in hit.lent] == [60, 80]
    assert all(kv == (None, None) for n in hit.lent for kv in n.payload.kv)
    assert hit.cache[0].keys.shape[2] == 512  # room for what the turn will add
    reference = make_cache()
    prefill(model, reference, tokens[:80])
    got = prefill(model, hit.cache, tokens[80:])
    want = prefill(model, reference, tokens[80:])
    assert mx.allclose(got, want, atol=ATOL, rtol=0).item()
    pc.release(hit)  # as after an error: no insert
    assert_unchanged(before, stored_arrays(pc))
    assert locked(pc) == [] and pc.total_bytes == 80 * bytes_per_token(make_cache, model)
