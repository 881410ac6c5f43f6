"""Script-mode chat on builtin:tiny: the cache changes nothing but the work done."""

from __future__ import annotations

import pytest
from chat_helpers import SCRIPT as TURNS
from chat_helpers import chat_json

LONG_SYSTEM = " ".join(f"Rule {i}: answer kindly and briefly about topic {i}." for i in range(14))

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]  # slow: starts ranks (tests/conftest.py)


def test_six_turns_same_replies_as_no_cache(tmp_path):
    cached = chat_json(TURNS, tmp_path / "a", "--session", "s")
    cold = chat_json(TURNS, tmp_path / "b", "--session", "s", "--no-cache")
    assert [t["reply"] for t in cached] == [t["reply"] for t in cold]
    assert len({t["reply"] for t in cached}) == len(TURNS), "replies must differ per prompt"
    assert all(t["cached_tokens"] == 0 for t in cold)
    for prev, turn in zip(cached, cached[1:], strict=False):
        # The previous prompt and every token of its reply (rendered as the exact tokens
        # generated, not re-encoded text) are served from the cache.
        assert turn["cached_tokens"] >= prev["prompt_tokens"] + prev["generated_tokens"]
        assert turn["prefilled_tokens"] == turn["prompt_tokens"] - turn["cached_tokens"]
        assert turn["prefilled_tokens"] < turn["prompt_tokens"] - prev["prompt_tokens"] + 20
    assert [t["prompt_tokens"] for t in cached] == [t["prompt_tokens"] for t in cold]


def test_retry_undo_switch_served_from_cache(tmp_path):
    script = [
        "Hello, who are you?",
        "Tell me about the sea.",
        "/retry",
        "/undo",
        "Tell me about the mountains.",
        "/new other",
        "What is two plus two?",
        "/switch s",
        "And the rivers?",
    ]
    cached = chat_json(script, tmp_path / "a", "--session", "s")
    cold = chat_json(script, tmp_path / "b", "--session", "s", "--no-cache")
    assert [t["reply"] for t in cached] == [t["reply"] for t in cold]
    first, second, retried, mountains, other, back = cached
    # /retry re-runs the same prompt: all of it but the last token comes from cache.
    assert retried["prompt_tokens"] == second["prompt_tokens"]
    assert retried["cached_tokens"] == retried["prompt_tokens"] - 1
    # /undo then a new question: the conversation before the undone exchange is cached.
    assert mountains["cached_tokens"] >= first["prompt_tokens"]
    assert other["session"] == "other" and back["session"] == "s"
    # Switching back hits what session s left in the cache before the switch.
    assert back["cached_tokens"] >= mountains["prompt_tokens"]


def test_shared_system_prompt_held_once(tmp_path):
    script = []
    for name in ("a", "b", "c", "d"):
        script += [f"/new {name}", f"Question from {name}?"]
    turns = chat_json(script, tmp_path, "--system", LONG_SYSTEM, "--max-tokens", "4")
    assert turns[0]["prompt_tokens"] > 300
    shared = turns[0]["prompt_tokens"] - 12  # all but the user line that differs
    for t in turns[1:]:
        assert t["cached_tokens"] >= shared
    # Bytes held: one copy of the shared prefix plus four short suffixes, not four copies.
    bpt = _bytes_per_token(turns)
    held = turns[-1]["cache_bytes"][0]
    distinct = sum(t["prompt_tokens"] + t["generated_tokens"] - shared for t in turns)
    assert held <= (shared + distinct) * bpt
    assert held < 1.5 * turns[0]["prompt_tokens"] * bpt, "the system prompt is stored once"


def _bytes_per_token(turns):
    adds = [e for t in turns for e in t["events"] if e["kind"] == "add" and e["tokens"]]
    return adds[0]["bytes"][0] / adds[0]["tokens"]


def test_small_budget_evicts_lru_not_in_use(tmp_path):
    script = []
    for name in ("a", "b", "c"):
        script += [f"/new {name}", f"Tell me about {name} and the sea and the mountains."]
    script += ["/switch a", "And more about a?", "/switch b", "And more about b?"]
    budget = 150_000  # about two of the three conversations at ~1 KB per token on tiny
    cached = chat_json(script, tmp_path / "a", "--cache-budget", str(budget), "--disk-budget", "0")
    cold = chat_json(script, tmp_path / "b", "--no-cache")
    assert [t["reply"] for t in cached] == [t["reply"] for t in cold]
    evicts = [e for t in cached for e in t["events"] if e["kind"] == "evict"]
    assert evicts, "a budget below the working set must evict"
    assert all(e["reason"] == "budget rank 0" for e in evicts)
    for t in cached:
        hits = {e["entry"] for e in t["events"] if e["kind"] == "hit"}
        evicted = {e["entry"] for e in t["events"] if e["kind"] == "evict"}
        assert not hits & evicted, "the entry a turn uses is never evicted"
        assert t["cache_bytes"][0] <= budget, "eviction left headroom for the whole turn"
