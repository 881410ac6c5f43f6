"""Prefill while the user types (issue 22): drafts edited, deleted, abandoned; budgets; ranks.

The same scenario runs on the engine itself, through LocalClient and through
ClusterClient on two ranks: every reply must equal the same turn without the cache
(temperature 0), every rank must stay within its budget after every turn, and a
draft the turn goes on from must have spared the turn its prefill.
"""

from __future__ import annotations

import json
import queue
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from chat_helpers import home_with_models

from exokv.core.records import TurnRequest, TurnResult
from exokv.rank.typeahead import DraftFeed, covered, stable_text
from exokv.wire.messages import Draft, Message, Save, Turn

BUDGET = 600 * 1024  # builtin:tiny: 1 KB per token on one rank: about 600 tokens

LONG = " ".join(f"stone {i} river light" for i in range(60))  # ~300 words
EDITED = LONG.replace("stone 7 river", "pebble 7 brook")  # changed in the middle


def test_the_stable_text_leaves_the_last_word_and_commands_out() -> None:
    assert stable_text("hello wor") == "hello"
    assert stable_text("hello world ") == "hello world"  # a finished word stays
    assert stable_text("one two\n\nthr") == "one two"
    assert stable_text("single") == ""
    assert stable_text("/switch other") == ""


def test_the_feed_steps_the_newest_draft_until_something_else_comes() -> None:
    over: list[Any] = []
    feed = DraftFeed(on_done=over.append)
    inbox: queue.Queue[Message] = queue.Queue()

    def draft(ident: str, text: str) -> Draft:
        return Draft(ident, "s", [], text)

    inbox.put(draft("d1", "a b"))
    inbox.put(draft("d2", "a b c"))
    assert feed.next(inbox).id == "d2" and over == ["d1"]  # the newer replaces it
    assert feed.next(inbox).id == "d2"  # stepped again while nothing else waits
    inbox.put(Turn(7, TurnRequest("s", [])))
    assert isinstance(feed.next(inbox), Turn) and over == ["d1", "d2"]
    inbox.put(draft("d3", "x y"))
    inbox.put(draft("d4", ""))  # abandoned
    inbox.put(Save(8, "s", []))
    assert isinstance(feed.next(inbox), Save) and over[-2:] == ["d3", "d4"]
    inbox.put(draft("d5", "x y"))
    assert feed.next(inbox).id == "d5"
    feed.stepped(0)  # done: no more steps, the next message is waited for
    assert over[-1] == "d5" and feed.pending is None


def test_covered_counts_draft_tokens_within_the_hit() -> None:
    assert covered([(0, 10), (10, 30)], 25) == 25
    assert covered([(5, 10)], 3) == 0


# -- the scenario, on whatever runs turns ------------------------------------------------


class Driver:
    """Turns and drafts on something that runs them; `after_step` checks the budget."""

    def __init__(
        self,
        turn: Callable[[TurnRequest], TurnResult],
        draft: Callable[[str, list[dict[str, str]], str], None],
    ) -> None:
        self.turn = turn
        self.draft = draft
        self.history: dict[str, list[dict[str, str]]] = {}
        self.results: list[TurnResult] = []

    def send(self, session: str, text: str) -> TurnResult:
        messages = self.history.setdefault(session, [])
        messages.append({"role": "user", "content": text})
        request = TurnRequest(session, list(messages), max_tokens=6)
        hot = self.turn(request)
        cold = self.turn(TurnRequest(**{**request.to_dict(), "use_cache": False}))
        assert hot.reply == cold.reply, f"{session}: {text[:30]!r}"
        for stats in hot.rank_stats:
            assert stats.budget is None or stats.cache_bytes <= stats.budget, stats
        messages.append({"role": "assistant", "content": hot.reply})
        self.results.append(hot)
        return hot

    def typing(self, session: str, text: str) -> None:
        self.draft(session, list(self.history.get(session, [])), text)


def scenario(d: Driver) -> None:
    # Typed ahead, then sent with a few more words: the turn starts from the draft.
    d.typing("a", LONG + " and the fin")
    first = d.send("a", LONG + " and the final words")
    assert first.typed_ahead_tokens > 100, first
    assert first.prefilled_tokens < first.prompt_tokens - first.typed_ahead_tokens + 20
    assert any(e.kind == "draft" for e in first.events)
    used = [e.tokens for e in first.events if e.kind == "draft-used"]
    assert used == [first.typed_ahead_tokens]
    # Edited in the middle after it was prefilled: the tokens after the edit are not used.
    d.typing("a", LONG + " tell me mo")
    edited = d.send("a", EDITED + " tell me more")
    assert edited.typed_ahead_tokens < edited.prompt_tokens // 2
    # Deleted: typed, then the line emptied, then something else sent.
    d.typing("a", LONG + " deleted ag")
    d.typing("a", "")
    d.send("a", "short one")
    # Abandoned, then /switch: the other session's turn, then back.
    d.typing("a", EDITED + " abandoned th")
    d.send("b", "another conversation entirely")
    d.send("a", "back again")


def _engine_driver(engine: Any) -> Driver:
    def draft(session: str, messages: list[dict[str, str]], text: str) -> None:
        if not text:
            return
        while engine.typeahead_step(session, messages, text) > 0:
            engine.cache.tree.check()
            assert engine.cache.total_bytes <= engine.budget  # after every step too

    return Driver(engine.turn, draft)


def test_engine_drafts_edited_deleted_abandoned(tiny: Any) -> None:
    from exokv.rank.engine import Engine, EngineOptions

    engine = Engine(*tiny, options=EngineOptions(budget=BUDGET))
    scenario(_engine_driver(engine))
    engine.cache.tree.check()


def test_draft_entries_are_evicted_first(tiny: Any) -> None:
    from exokv.rank.engine import Engine, EngineOptions

    engine = Engine(*tiny, options=EngineOptions(budget=BUDGET))
    d = _engine_driver(engine)
    d.send("a", "a first conversation to keep")
    kept = {n.id for n in engine.cache.tree.nodes()}
    d.typing("b", LONG + " never se")  # abandoned: its entries are the first to go
    new = {n.id for n in engine.cache.tree.nodes()} - kept
    drafted = {i for i in new if engine.cache.tree.find(i).last_used < 0}
    # The draft's own entries go first; the head it shares with "a" (cut off a's entry) not.
    assert drafted and len(new - drafted) == 1
    shared = engine.cache.tree.find((new - drafted).pop())
    assert shared.depth < len(engine.render([{"role": "user", "content": "a"}]))
    third = d.send("c", LONG.replace("stone", "gravel") + " needs room")
    evicted = [e.entry for e in third.events if e.kind == "evict"]
    assert evicted, "the budget was never tight"
    first_kept = next((i for i, e in enumerate(evicted) if e not in drafted), len(evicted))
    assert set(evicted[:first_kept]) == drafted & set(evicted) and first_kept > 0


def test_a_draft_over_the_budget_stops_and_the_budget_holds(tiny: Any) -> None:
    from exokv.rank.engine import Engine, EngineOptions

    engine = Engine(*tiny, options=EngineOptions(budget=100 * 1024))
    steps = 0
    while engine.typeahead_step("a", [], LONG + " x") > 0:
        steps += 1
        assert steps < 10, "a draft the budget cannot hold is stepped forever"
    assert engine.cache.total_bytes <= engine.budget


def test_through_the_local_client(models_dir: Path, tmp_path: Path, monkeypatch) -> None:
    from exokv.client import make_client
    from exokv.frontend.start import ChatOptions, validate

    monkeypatch.setenv("EXOKV_HOME", str(home_with_models(tmp_path / "h", models_dir)))
    client = make_client(validate(ChatOptions(model="builtin:tiny", seed=0, cache_budget="600KB")))
    try:
        d = Driver(client.turn, lambda s, m, t: client.draft(s, m, t, wait=True))
        scenario(d)
        # Not waited for: the turn takes the lock after the step in flight, and is right.
        client.draft("a", list(d.history["a"]), LONG + " racing ent")
        d.send("a", LONG + " racing enter")
        _the_toolbar_learns_the_drafts_cost(client)
    finally:
        client.close()


def _the_toolbar_learns_the_drafts_cost(client: Any) -> None:
    """What the REPL's toolbar shows: the last step's tokens and how many the tree holds."""
    client.draft("fresh", [], LONG + " and then some", wait=True)
    cost = client.draft_cost("fresh")
    assert cost is not None and cost.session == "fresh", cost
    assert 0 < cost.cached <= cost.tokens and cost.cached > cost.tokens // 2, cost
    assert client.draft_cost("another") is None


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_through_two_ranks_with_identical_events(
    models_dir: Path, tmp_path: Path, monkeypatch
) -> None:
    from exokv.client.cluster import ClusterClient
    from exokv.frontend.start import ChatOptions, validate

    home = home_with_models(tmp_path / "h", models_dir)
    monkeypatch.setenv("EXOKV_HOME", str(home))
    monkeypatch.setenv("EXOKV_RANK_LOG", "1")
    monkeypatch.delenv("EXOKV_DEBUG", raising=False)
    # No disk tier: a step whose prefix was spilled adds the tier's own load gather (the
    # one the turn would pay after Enter otherwise); here every step must have one at most.
    opts = ChatOptions(
        model="builtin:tiny",
        ranks=2,
        seed=0,
        cache_budget="600KB",
        disk_budget="0",
        starting_port=25880,
    )
    client = ClusterClient(validate(opts))
    try:
        d = Driver(client.turn, lambda s, m, t: client.draft(s, m, t, wait=True))
        scenario(d)
        _the_toolbar_learns_the_drafts_cost(client)  # rank 0's DraftStep, over the channel
    finally:
        client.close()
    logs = [
        [json.loads(x) for x in (home / "ranks" / f"rank-{r}.jsonl").read_text().splitlines()]
        for r in (0, 1)
    ]

    def decided(log: list[dict[str, Any]]) -> list[Any]:
        return [(line.get("draft_step"), line.get("events")) for line in log]

    assert decided(logs[0]) == decided(logs[1])  # the same steps and events on every rank
    steps = [line for line in logs[0] if "draft_step" in line]
    assert steps, "no typeahead step ran on the ranks"
    for line in steps:  # at most one collective per typeahead step besides its message
        assert line["collectives"]["gather"] <= 1 and line["collectives"]["any"] == 0, line
    turns = [line for line in logs[0] if "turn" in line]
    assert any(e["kind"] == "draft-used" for t in turns for e in t["events"])


def test_the_draft_worker_frees_its_thread_state_before_close_returns() -> None:
    """close() returns once the worker has run `at_exit` in its own thread and ended:
    a thread that ran the model must free MLX's per-thread state before the process
    exits (exokv.client.typeahead)."""
    import threading

    from exokv.client.typeahead import DraftRunner

    stepped, freed = threading.Event(), []
    runner = DraftRunner(
        lambda s, m, t: stepped.set() or 0,
        threading.Lock(),
        at_exit=lambda: freed.append(threading.current_thread()),
    )
    runner.wait(runner.submit("a", [], "some draft"), timeout=30)
    assert stepped.is_set()
    worker = runner._thread
    assert worker is not None and worker.is_alive()
    runner.close()
    assert freed == [worker] and not worker.is_alive()
    runner.submit("a", [], "after close")  # ignored: nothing runs, nothing hangs
    assert freed == [worker]


# No disk tier: closing is quick, so the exit follows the worker's wake-up at once.
EXIT_SCRIPT = """
from exokv.client.local import LocalClient
from exokv.rank.engine import EngineOptions
from exokv.core.records import TurnRequest

client = LocalClient("builtin:tiny", EngineOptions())
client.draft("a", [], "Tell me about rivers and", wait=True)
client.turn(TurnRequest("a", [{"role": "user", "content": "Tell me about rivers"}], 4))
client.close()
print("closed")
"""


@pytest.mark.slow
def test_a_process_whose_drafts_ran_the_model_exits_cleanly(
    models_dir: Path, tmp_path: Path
) -> None:
    """Without freeing the draft thread's MLX state, such a process aborted at exit in
    4 of 6 runs here ("terminate called without an active exception", exit 134)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "EXOKV_HOME": str(home_with_models(tmp_path / "h", models_dir, link=True))}
    for _ in range(3):
        proc = subprocess.run(
            [sys.executable, "-c", EXIT_SCRIPT],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0 and proc.stdout.strip() == "closed", proc.stderr[-2000:]
        assert "terminate called" not in proc.stderr
