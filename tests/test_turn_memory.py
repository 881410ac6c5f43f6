"""Peak memory of a cached turn: the conversation's K/V held once, as a carried cache
holds it (the tree lends the hit's K/V to the turn instead of copying it)."""

from __future__ import annotations

import gc

import mlx.core as mx
import numpy as np

from exokv.core.records import TurnRequest
from exokv.rank.engine import Engine
from tests.test_cache_budget import Carried

LONG = " ".join(f"stone {i} river light" for i in range(240))  # ~2,100 tokens


def peak_of(turn, held):
    """Run turn(); its peak MLX memory above everything but the cache (`held()` bytes)."""
    gc.collect()
    mx.clear_cache()
    base = mx.get_active_memory() - held()
    mx.reset_peak_memory()
    out = turn()
    return out, mx.get_peak_memory() - base


def tree_arrays(engine: Engine) -> dict[int, list[np.ndarray]]:
    return {
        n.id: [np.array(a) for kv in n.payload.kv for a in kv] for n in engine.cache.tree.nodes()
    }


def test_a_cached_turn_holds_the_conversation_once(tiny):
    model, tokenizer = tiny
    first = [{"role": "user", "content": LONG}]
    engine = Engine(model, tokenizer)
    r1 = engine.turn(TurnRequest("s", first, max_tokens=16))
    second = first + [
        {"role": "assistant", "content": r1.reply},
        {"role": "user", "content": "Why?"},
    ]
    stored = engine.cache.total_bytes
    before = tree_arrays(engine)
    r2, peak = peak_of(
        lambda: engine.turn(TurnRequest("s", second, max_tokens=16)),
        lambda: engine.cache.total_bytes,
    )
    assert r2.cached_tokens == r1.prompt_tokens + r1.generated_tokens > 2000

    # The same turn on one cache carried through the conversation (mlx_lm.chat): its
    # peak above its cache is the model's own working memory (attention scores, ...).
    carried = Carried(Engine(model, tokenizer))
    carried.turn(TurnRequest("s", first, max_tokens=16))
    reply, carried_peak = peak_of(
        lambda: carried.turn(TurnRequest("s", second, max_tokens=16)),
        lambda: sum(c.nbytes for c in carried.cache),
    )
    working = carried_peak - sum(c.nbytes for c in carried.cache)
    new = (r2.prompt_tokens - r2.cached_tokens + r2.generated_tokens) * engine.bytes_per_token
    assert peak <= 1.15 * stored + new + working, (peak, stored, new, working)
    assert peak <= 1.05 * carried_peak, (peak, carried_peak)

    # Replies as without the cache, and the tree holds what it held (plus the new turn).
    cold = Engine(model, tokenizer)
    c1 = cold.turn(TurnRequest("s", first, max_tokens=16, use_cache=False))
    c2 = cold.turn(TurnRequest("s", second, max_tokens=16, use_cache=False))
    assert [r1.reply, r2.reply] == [c1.reply, c2.reply] and r2.reply == reply
    after = tree_arrays(engine)
    for node_id, arrays in before.items():
        for a, b in zip(arrays, after[node_id], strict=True):
            np.testing.assert_array_equal(a, b)
    # Fetched again, the K/V is what was stored before the turn.
    hit = engine.cache.fetch(engine.render(second))
    assert hit.length > r2.cached_tokens and not hit.lent
    old = [n for n in hit.path if n.id in before]
    assert old and old[-1].depth == r2.cached_tokens
    for layer, c in enumerate(hit.cache):
        for part, got in enumerate((c.keys, c.values)):
            want = np.concatenate([before[n.id][2 * layer + part] for n in old], axis=2)
            np.testing.assert_array_equal(np.array(got[:, :, : want.shape[2]]), want)
    engine.cache.release(hit)
