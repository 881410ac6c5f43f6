"""`exokv cache entries`: each entry's own created and last-used times across runs.

Two chats a minute apart, written through the store's API on a faked clock, as a chat
with the disk tier writes them: the second run starts with the first one's tree
(same node ids, depths, hit counts and tree clock), records all of it at its first
turn, and reuses only some of it."""

from __future__ import annotations

import time
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

import exokv.state.store as store_module
from exokv.cli import cache as cache_cli
from exokv.core import tables
from exokv.core.records import CacheEvent, EntryInfo, TurnResult
from exokv.state import Store
from exokv.state.queries import iso

MODEL = "builtin:tiny"
# Session a's first turn: today at 03:11:30, so the table shows times of day.
T0 = datetime.now().replace(hour=3, minute=11, second=30, microsecond=0).timestamp()


class _Clock:
    """`time` for the store, with `time()` set by the test; the rest is the real module."""

    def __init__(self) -> None:
        self.now = T0

    def time(self) -> float:
        return self.now

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    fake = _Clock()
    monkeypatch.setattr(store_module, "time", fake)
    return fake


def _entry(node: int, parent: int | None, session: str, depth: int, hits: int, tick: int):
    return EntryInfo(node, parent, session, 10, depth, [100], hits, tick)


def _turn(session: str, events: list[CacheEvent], entries: list[EntryInfo]) -> TurnResult:
    return TurnResult(
        session=session,
        reply="r",
        prompt_tokens=40,
        cached_tokens=10 if any(e.kind == "hit" for e in events) else 0,
        prefilled_tokens=30,
        generated_tokens=4,
        ttft_s=0.01,
        decode_tps=50.0,
        overhead_s=0.0,
        ranks=1,
        events=events,
        entries=entries,
    )


def _record(store: Store, run: int, clock: _Clock, at: float, result: TurnResult) -> None:
    clock.now = at
    store.record_turn(run, result.session, [{"role": "user", "content": str(at)}], result, MODEL)


def _two_runs(home: Path, clock: _Clock) -> None:
    """Run 1 (session a): entry 1 at T0, entry 2 under it at T0+5 (a hit on 1). Run 2,
    a minute later (session b): the restored 1 and 2 recorded unchanged at its first
    turn with b's new entry 3; ten seconds on, a hit on entry 1 only."""
    with Store.open(home) as store:
        clock.now = T0
        run = store.start_run(MODEL, 1, [None])
        add = CacheEvent("add", 1, 1, 10, [100], "a")
        _record(store, run, clock, T0, _turn("a", [add], [_entry(1, None, "a", 10, 0, 1)]))
        events = [CacheEvent("hit", 2, 1, 10, [100], "a"), CacheEvent("add", 2, 2, 10, [100], "a")]
        tree = [_entry(1, None, "a", 10, 1, 3), _entry(2, 1, "a", 20, 0, 3)]
        _record(store, run, clock, T0 + 5, _turn("a", events, tree))
        store.end_run(run)

        clock.now = T0 + 60
        run = store.start_run(MODEL, 1, [None])
        restored = [_entry(1, None, "a", 10, 1, 3), _entry(2, 1, "a", 20, 0, 3)]
        new = [_entry(3, None, "b", 10, 0, 4)]
        add = CacheEvent("add", 1, 3, 10, [100], "b")
        _record(store, run, clock, T0 + 60, _turn("b", [add], restored + new))
        hit = CacheEvent("hit", 2, 1, 10, [100], "b")
        _record(store, run, clock, T0 + 70, _turn("b", [hit], [_entry(1, None, "a", 10, 2, 5)]))
        store.end_run(run)


def _stamp(iso: str) -> float:
    return datetime.fromisoformat(iso).timestamp()


def test_each_entry_shows_its_own_created_and_last_used(tmp_path: Path, clock: _Clock) -> None:
    _two_runs(tmp_path, clock)
    with Store.open(tmp_path) as store:
        rows = {e["id"]: e for e in store.entries()}
    times = {i: (_stamp(e["created"]), _stamp(e["last_used"])) for i, e in rows.items()}
    assert times == {
        1: (T0, T0 + 70),  # cached in run 1, hit again in run 2
        2: (T0 + 5, T0 + 5),  # restored by run 2 and not used there
        3: (T0 + 60, T0 + 60),  # run 2's own
    }
    assert all(created <= used for created, used in times.values())
    assert times[1][0] != times[1][1]
    assert rows[1]["hits"] == 2 and {e["run"] for e in rows.values()} == {2}


def test_an_id_a_new_tree_made_again_has_the_new_times(tmp_path: Path, clock: _Clock) -> None:
    """A run that did not restore the tree makes its nodes anew, ids from 1: its `add`
    events say so, whatever an earlier run's node of that id was."""
    with Store.open(tmp_path) as store:
        for start in (T0, T0 + 60):
            clock.now = start
            run = store.start_run(MODEL, 1, [None])
            add = CacheEvent("add", 1, 1, 10, [100], "a")
            _record(store, run, clock, start, _turn("a", [add], [_entry(1, None, "a", 10, 0, 1)]))
            store.end_run(run)
        (entry,) = store.entries()
    assert (_stamp(entry["created"]), _stamp(entry["last_used"])) == (T0 + 60, T0 + 60)


def test_the_table_shows_created_and_says_what_hits_count(
    tmp_path: Path, clock: _Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    _two_runs(tmp_path, clock)
    monkeypatch.setenv("EXOKV_HOME", str(tmp_path))
    monkeypatch.setenv("COLUMNS", "80")
    result = CliRunner().invoke(cache_cli.cache_app, ["entries"])
    assert result.exit_code == 0, result.output
    out = result.output
    header = next(line for line in out.splitlines() if line.startswith("Id"))
    assert "Created" in header and "Last used" in header
    row = next(line for line in out.splitlines() if line.split()[:1] == ["1"])
    created, used = (tables.when(iso(t)) for t in (T0, T0 + 70))
    assert created != used and row.rstrip().endswith(f"{created}  {used}"), row
    assert "Hits: the turns that reused the entry" in " ".join(out.split())
    assert "`cache stats` counts this run's turns" in " ".join(out.split())
