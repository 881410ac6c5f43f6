"""/pin: a pinned conversation's cache is evicted after every unpinned one, alike on
every rank, and the pin outlives the chat that set it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from chat_helpers import home_with_models
from test_cluster import rank_log, run_script

pytestmark = pytest.mark.slow  # starts ranks, servers or real models: see tests/conftest.py

A = "Tell me a long story about the sea and the ships that sail on it at night"
B = "Why is the sky blue and what makes the clouds white in summer"
C = "What do bees do all day in the garden when the sun is out"
# Three conversations; the budget holds about two, so the third evicts the oldest
# (a) unless a is pinned. Then a goes on: its prompt is cached only if a was kept.
SCRIPT = ["/new a", A, "/new b", B, "/new c", C, "/switch a", "And then?"]
PINNED = [*SCRIPT[:2], "/pin", *SCRIPT[2:]]


def _evicted(turns: list[dict[str, Any]]) -> set[str]:
    return {e["session"] for t in turns for e in t["events"] if e["kind"] == "evict"}


def _flags(ranks: int, port: int, budget: str = "") -> tuple[str, ...]:
    # The KV cache grows in steps of 256 tokens (about 262 KB here): the headroom a turn
    # asks for. Above it, this budget holds two of these conversations but not three.
    budget = budget or ("350000" if ranks == 1 else "175000,175000")
    return (
        *("--model", "builtin:tiny", "--max-tokens", "16", "-n", str(ranks)),
        *("--cache-budget", budget, "--disk-budget", "0", "--starting-port", str(port)),
    )


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("ranks", "port"), [(1, 27900), (2, 27910)])
def test_a_pinned_conversation_keeps_its_cache_while_others_are_evicted(
    ranks: int, port: int, tmp_path: Path, models_dir: Path
) -> None:
    env = {"EXOKV_RANK_LOG": "1"} if ranks > 1 else {}
    plain = run_script(home_with_models(tmp_path / "p", models_dir), SCRIPT, *_flags(ranks, port))
    home = home_with_models(tmp_path / "h", models_dir)
    pinned = run_script(home, PINNED, *_flags(ranks, port + 5), env=env)
    # Unpinned, a is the oldest and goes; pinned, b goes instead and a's next turn is warm.
    assert "a" in _evicted(plain) and "a" not in _evicted(pinned) and "b" in _evicted(pinned)
    warm, cold = pinned[-1]["cached_tokens"], plain[-1]["cached_tokens"]
    assert warm > pinned[0]["prompt_tokens"] > cold, (warm, cold)
    assert [t["reply"] for t in pinned] == [t["reply"] for t in plain]  # pins change no reply
    if ranks > 1:
        logs = [rank_log(home, 0), rank_log(home, 1)]
        for t0, t1 in zip(*logs, strict=True):
            assert t0["events"] == t1["events"]  # the same evictions on every rank


@pytest.mark.timeout(240)
def test_a_pin_outlives_the_chat_and_unpin_takes_it_back(tmp_path: Path, models_dir: Path) -> None:
    home = home_with_models(tmp_path / "h", models_dir)
    run_script(home, ["/new a", A, "/pin"], *_flags(1, 27920))
    # A new chat on the same home (no disk tier: the cache starts empty): a is still
    # pinned, so d is evicted for e, not a, and a's last turn is warm. (a grew: a
    # larger budget, which still holds two of these conversations, not three.)
    again = ["/switch a", "More please", "/new d", B, "/new e", C, "/switch a", "And then?"]
    turns = run_script(home, again, *_flags(1, 27925, "380000"))
    assert "a" not in _evicted(turns) and "d" in _evicted(turns)
    assert turns[-1]["cached_tokens"] > turns[0]["prompt_tokens"]
    # Unpinned, a is the oldest once more, and the next conversations evict it.
    script = ["/unpin a", "/switch a", "Once more", "/new f", A + "!", "/new g", B + "!"]
    turns = run_script(home, script, *_flags(1, 27930, "380000"))
    assert "a" in _evicted(turns)


def test_pin_commands_say_what_they_did(tmp_path: Path, models_dir: Path) -> None:
    from chat_helpers import Chat

    chat = Chat(home_with_models(tmp_path / "h", models_dir), "--model", "builtin:tiny")
    assert chat.send("/pin nobody")["ok"] is False
    chat.send("Hello")
    first = chat.send("/pin")
    assert first["ok"] and "pinned" in first["message"]
    assert "already pinned" in chat.send("/pin")["message"]
    rows = chat.send("/sessions")["data"]
    assert [r["pinned"] for r in rows if r["current"]] == [True]
    assert "unpinned" in chat.send("/unpin")["message"]
    assert "not pinned" in chat.send("/unpin")["message"]
    code, err = chat.finish()
    assert code == 0, err


def test_cache_entries_show_the_pins(tmp_path: Path, models_dir: Path) -> None:
    from chat_helpers import cache_json

    home = home_with_models(tmp_path / "h", models_dir)
    run_script(home, ["/new a", A, "/pin", "/new b", B], "--model", "builtin:tiny")
    rows = cache_json(home, "entries")["entries"]
    assert {r["session"]: r["pinned"] for r in rows if r["session"] in "ab"} == {
        "a": True,
        "b": False,
    }
