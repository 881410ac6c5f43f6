"""The engine on every cache kind: replies, a shared prefix held once (measured with
mx.get_active_memory), and the budget a cap after every turn, with exact figures."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import mlx.core as mx
import pytest

from exokv.cache import kinds
from exokv.core.records import TurnRequest
from exokv.rank.engine import Engine, EngineOptions, decode, prefill
from tests.test_cache_kinds import KINDS, model_for, stored_bytes

SYSTEM = "You answer briefly. " + " ".join(f"rule {i} is kept" for i in range(12))
QUESTIONS = [
    "What is a river?",
    "Name a stone.",
    "Why is the sky blue?",
    "Count to three.",
    "Say hello.",
    "What is rain?",
    "Pick a colour.",
    "Who are you?",
]


@pytest.fixture(scope="module")
def tokenizer(models_dir: Path):
    from exokv.model.resolve import load_model

    old = os.environ.get("EXOKV_HOME")
    os.environ["EXOKV_HOME"] = str(models_dir.parent)
    try:
        return load_model("builtin:tiny")[1]
    finally:
        if old is None:
            del os.environ["EXOKV_HOME"]
        else:
            os.environ["EXOKV_HOME"] = old


def engine_for(kind: str, tokenizer, budget: int | None = None) -> Engine:
    model, _ = model_for(kind)
    max_kv = KINDS[kind][1]
    return Engine(model, tokenizer, options=EngineOptions(budget=budget, max_kv_size=max_kv))


def chats(n: int = 3, turns: int = 2) -> list[tuple[str, list[dict[str, str]]]]:
    """n conversations sharing the system prompt, interleaved turn by turn."""
    out = []
    history = {f"s{i}": [{"role": "system", "content": SYSTEM}] for i in range(n)}
    for t in range(turns):
        for i in range(n):
            history[f"s{i}"].append({"role": "user", "content": QUESTIONS[(i + t) % 8]})
            out.append((f"s{i}", list(history[f"s{i}"])))
    return out


def play(engine: Engine, script, max_tokens: int = 8, use_cache: bool = True, check=None):
    """Run the script; each reply goes into its conversation's history."""
    replies: dict[str, list[str]] = {}
    out = []
    for session, messages in script:
        full = _with_replies(messages, replies.get(session, []))
        result = engine.turn(
            TurnRequest(session=session, messages=full, max_tokens=max_tokens, use_cache=use_cache)
        )
        replies.setdefault(session, []).append(result.reply)
        out.append(result)
        if check is not None:
            check(result)
    return out


def _with_replies(messages, replies):
    out, k = [], 0
    for m in messages:
        out.append(m)
        if m["role"] == "user" and k < len(replies) and m is not messages[-1]:
            out.append({"role": "assistant", "content": replies[k]})
            k += 1
    return out


class Carried:
    """One cache carried from turn to turn, as mlx_lm.chat does (one conversation)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.cache = engine._new_cache()
        self.held: list[int] = []

    def turn(self, request: TurnRequest):
        tokens = self.engine.render(request.messages)
        assert tokens[: len(self.held)] == self.held
        prefill(self.engine.model, self.cache, tokens[len(self.held) : -1])
        generated, reply, *_ = decode(
            self.engine.model, self.engine.tokenizer, tokens[-1:], self.cache, request.max_tokens, 0
        )
        self.engine.reply_spelled(reply, generated)
        self.held = tokens + generated
        return reply


@pytest.mark.parametrize("kind", list(KINDS))
def test_replies_equal_no_cache_or_a_carried_cache(kind, tokenizer):
    if kind == "window-keep":
        # mlx-lm's rotating cache with kept tokens gives other results for other
        # chunkings, so --no-cache (the whole prompt in one go) is not the reference:
        # one cache carried through the conversation is (what mlx_lm.chat does).
        script = chats(1, 4)
        engine = engine_for(kind, tokenizer)
        cached = [r.reply for r in play(engine, script)]
        carried = Carried(engine_for(kind, tokenizer))
        replies: list[str] = []
        for _, messages in script:
            full = _with_replies(messages, replies)
            replies.append(carried.turn(TurnRequest("s0", full, max_tokens=8)))
        assert cached == replies
        return
    script = chats(3, 2)
    cached = play(engine_for(kind, tokenizer), script)
    plain = play(engine_for(kind, tokenizer), script, use_cache=False)
    assert [r.reply for r in cached] == [r.reply for r in plain]
    assert len({r.reply for r in plain}) > 1  # the replies depend on the prompt
    # From the third turn on every turn reuses the tree: the second conversation left
    # the first one's path mid-edge, where only full attention can be cut, so its
    # run stored that point for the others.
    assert all(r.cached_tokens > 0 for r in cached[2:])


@pytest.mark.parametrize("kind", list(KINDS))
def test_budget_is_a_cap_after_every_turn(kind, tokenizer):
    probe = engine_for(kind, tokenizer)
    play(probe, chats(3, 2))
    full = probe.cache.total_bytes
    budget = full * 2 // 3

    def check(result):
        held = engine.cache.total_bytes
        assert held <= budget, (held, budget)
        assert held == stored_bytes(engine.cache)  # our counter is what the arrays hold
        assert result.rank_stats[0].cache_bytes == held
        assert sum(e.bytes[0] for e in engine.entries()) == held  # entries, from the counts
        assert engine.cache.tree.weight == held  # the tree's own running sum
        live = {e.id: e for e in engine.entries()}
        assert all(live[e.id] == e for e in result.entries)  # what the turn changed, current

    engine = engine_for(kind, tokenizer, budget=budget)
    results = play(engine, chats(3, 2), check=check)
    assert sum(r.evictions for r in results) > 0
    assert any(r.cached_tokens > 0 for r in results)


@pytest.mark.parametrize("kind", ["window", "state", "mla"])
def test_a_conversation_larger_than_the_budget_keeps_its_longest_prefix(kind, tokenizer):
    engine = engine_for(kind, tokenizer, budget=1)
    engine.budget = engine.coord.budget = 40 * engine.bytes_per_token  # a few dozen tokens
    result = play(engine, chats(1, 1), max_tokens=6)[0]
    reasons = [e.reason for e in result.events if e.kind == "evict"]
    assert reasons and reasons[-1].startswith("over budget: kept ")
    kept, total = (int(x) for x in reasons[-1].split("kept ")[1].split(" tokens")[0].split(" of "))
    assert 0 <= kept < total == result.prompt_tokens + result.generated_tokens
    assert engine.cache.total_bytes <= engine.budget
    assert engine.cache.total_bytes == stored_bytes(engine.cache)


@pytest.mark.parametrize("kind", list(KINDS))
def test_shared_prefix_is_held_once_in_memory(kind, tokenizer):
    """8 conversations sharing a system prompt hold at most 1.3x the bytes of the shared
    prompt plus their distinct suffixes (and where the model has states, one where they
    leave the shared prompt, and one at each prompt's end and each reply's end),
    measured as MLX's active memory, not by our own counters. The texts are long
    enough that the allocator's rounding of small arrays does not dominate."""
    engine = engine_for(kind, tokenizer)
    system = SYSTEM * 8
    script = [
        (f"s{i}", [{"role": "system", "content": system}, {"role": "user", "content": q * 6}])
        for i, q in enumerate(QUESTIONS)
    ]
    play(engine, script[:1], use_cache=False)  # warm up: compiled kernels, buffers
    gc.collect()
    mx.clear_cache()
    before = mx.get_active_memory()
    results = play(engine, script, max_tokens=4)
    gc.collect()
    mx.clear_cache()
    held = mx.get_active_memory() - before
    rates = engine.coord.rates
    distinct = sum(len(n.key) for n in engine.cache.tree.nodes())
    states = 1 + 2 * len(script)
    ideal = distinct * engine.bytes_per_token + states * rates.get(kinds.STATE, 0)
    assert held <= 1.3 * ideal, (held, ideal)
    assert engine.cache.total_bytes <= held
    assert all(r.cached_tokens > 0 for r in results[2:])


# A pasted paragraph: several sliding windows (16 and 24 tokens here) long.
PASTED = " ".join(f"line {i} of the pasted report says the river rose again" for i in range(8))


def _retries(engine: Engine, use_cache: bool = True, check=None) -> list:
    """A long message, /retry (the same messages again), a second long message, /retry."""

    def turn(messages):
        request = TurnRequest("r", messages, max_tokens=8, use_cache=use_cache)
        result = engine.turn(request)
        if check is not None:
            check(result)
        return result

    one = turn(_pasted())
    return [one, turn(_pasted()), turn(_pasted(one.reply)), turn(_pasted(one.reply))]


def _pasted(reply: str | None = None) -> list[dict[str, str]]:
    """The first long message, or with `reply` to it, the second."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": PASTED}]
    if reply is None:
        return messages
    return [*messages, {"role": "assistant", "content": reply},
            {"role": "user", "content": "And upstream? " + PASTED}]  # fmt: skip


@pytest.mark.parametrize("kind", list(KINDS))
def test_retry_after_a_long_message_reuses_its_whole_prompt_within_the_budget(kind, tokenizer):
    """Every cache kind serves /retry from the end of its prompt (all of it but the token
    decode runs), as full attention does: the turn stored that point for its sliding
    windows and states. Counted in the budget like any entry: under a budget that holds
    this conversation but not another one beside it, the other is evicted, the budget
    holds after every turn, the byte counts stay exact, and the replies are unchanged."""
    probe = engine_for(kind, tokenizer)
    _retries(probe)
    budget = probe.cache.total_bytes * 6 // 5

    def check(result):
        held = engine.cache.total_bytes
        assert held <= budget, (held, budget)
        assert held == stored_bytes(engine.cache) == engine.cache.tree.weight
        assert result.rank_stats[0].cache_bytes == held

    engine = engine_for(kind, tokenizer, budget=budget)
    other = play(engine, chats(2, 2), check=check)  # other conversations, evicted for it
    results = _retries(engine, check=check)
    assert sum(r.evictions for r in other + results) > 0
    one, retry, two, retry2 = results
    for retried, original in ((retry, one), (retry2, two)):
        assert retried.prompt_tokens > 100
        assert retried.cached_tokens == retried.prompt_tokens - 1, (kind, retried.cached_tokens)
        assert retried.reply == original.reply
    if kind == "window-keep":  # the reference is a carried cache (see above)
        carried = Carried(engine_for(kind, tokenizer))
        messages = (_pasted(), _pasted(one.reply))
        want = [carried.turn(TurnRequest("r", m, max_tokens=8)) for m in messages]
        assert [one.reply, two.reply] == want
    else:
        plain = _retries(engine_for(kind, tokenizer), use_cache=False)
        assert [r.reply for r in results] == [r.reply for r in plain]
