"""`exokv cache ...` through the real entry point: empty homes, JSON documents, damaged
databases, `clear`, and readers polling while a writer records turns."""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from pathlib import Path

import pytest
from chat_helpers import cache_json, exokv_text
from typer.testing import CliRunner

from exokv.cli import cache as cache_cli
from exokv.core.records import CacheEvent, EntryInfo, RankStats, TurnResult
from exokv.state import Store, caches_dir, db_path, register_chat

pytestmark = pytest.mark.slow  # starts ranks, servers or real models: see tests/conftest.py

MODEL = "builtin:tiny"
COMMANDS = ["stats", "entries", "pressure", "evictions"]


def turn(i: int, live: int = 3) -> TurnResult:
    """Turn i adds entry i and evicts entry i-live, so every count follows from the turn count."""
    events = [CacheEvent("add", i, i, 10, [100, 50], "s")]
    if i >= live:
        events.append(CacheEvent("evict", i, i - live, 10, [100, 50], "s", "budget", [0.1, 0.9]))
    kept = range(max(0, i - live + 1), i + 1)
    return TurnResult(
        session="s",
        reply="r",
        prompt_tokens=100 + i,
        cached_tokens=7 * i,
        prefilled_tokens=100 + i - 7 * i,
        generated_tokens=8,
        ttft_s=0.01,
        decode_tps=50.0,
        overhead_s=0.0,
        ranks=2,
        decision=i,
        events=events,
        entries=[EntryInfo(k, None, "s", 10, 1, [100, 50], 0, k) for k in kept],
        rank_stats=[
            RankStats(0, 100 * len(kept), len(kept), 1000, i / 100, 1 << 30, 1 << 20, 1 << 10),
            RankStats(1, 50 * len(kept), len(kept), 500, i / 50, 1 << 30, 1 << 20, 1 << 10),
        ],
    )


def expected(n: int, live: int = 3) -> dict:
    """What stats must say after exactly n turns of ``turn``."""
    kept = min(n, live)
    return {
        "turns": n,
        "hits": max(0, n - 1),
        "misses": min(n, 1),
        "tokens_saved": 7 * n * (n - 1) // 2,
        "evictions": max(0, n - live),
        "entries": kept,
        "bytes": 150 * kept,
    }


def populate(home: Path, turns: int = 5, end: bool = True) -> int:
    with Store.open(home) as store:
        run = store.start_run(MODEL, 2, [1000, 500])
        store.ensure_session("s", MODEL, "sys")
        for i in range(turns):
            store.record_turn(run, "s", [{"role": "user", "content": str(i)}], turn(i), MODEL)
        if end:
            store.end_run(run)
    return run


# -- an empty home ------------------------------------------------------------


@pytest.mark.parametrize("command", COMMANDS)
def test_commands_on_an_empty_home_are_friendly(tmp_path: Path, command: str) -> None:
    home = tmp_path / "home"
    proc = exokv_text(home, "cache", command)
    assert proc.returncode == 0, proc.stderr
    assert "No sessions yet" in proc.stdout
    assert not home.exists(), "a read-only command must not create state"


def test_json_on_an_empty_home_is_well_formed(tmp_path: Path) -> None:
    home = tmp_path / "home"
    stats = cache_json(home, "stats")
    assert stats["runs"] == [] and stats["ranks"] == [] and stats["sessions"] == 0
    assert stats["total"]["turns"] == 0 and stats["total"]["hit_rate"] is None
    assert cache_json(home, "entries") == {"runs": [], "entries": []}
    assert cache_json(home, "pressure") == {"runs": [], "ranks": []}
    assert cache_json(home, "evictions") == {"evictions": []}
    assert not home.exists()


def test_sessions_without_cache_activity(tmp_path: Path) -> None:
    with Store.open(tmp_path) as store:
        store.ensure_session("s", MODEL)
    proc = exokv_text(tmp_path, "cache", "stats")
    assert proc.returncode == 0 and "No cache activity" in proc.stdout


# -- the documents ----------------------------------------------------------------


def test_stats_entries_pressure_evictions_agree_with_the_turns(tmp_path: Path) -> None:
    run = populate(tmp_path, turns=5)
    want = expected(5)
    stats = cache_json(tmp_path, "stats")
    assert [r["id"] for r in stats["runs"]] == [run]
    total = stats["total"]
    for key, value in want.items():
        assert total[key] == value, key
    assert total["budget"] == 1500
    assert [(r["rank"], r["bytes"], r["budget"]) for r in stats["ranks"]] == [
        (0, 300, 1000),
        (1, 150, 500),
    ]
    assert [r["budget_pct"] for r in stats["ranks"]] == [30.0, 30.0]
    assert all(r["hits"] == 4 and r["evictions"] == 2 for r in stats["ranks"])

    entries = cache_json(tmp_path, "entries")["entries"]
    assert [e["id"] for e in entries] == [2, 3, 4]
    assert all(e["bytes"] == [100, 50] and e["total_bytes"] == 150 for e in entries)
    assert cache_json(tmp_path, "entries", "--session", "nobody")["entries"] == []

    pressure = cache_json(tmp_path, "pressure")["ranks"]
    assert [(p["rank"], p["pressure"]) for p in pressure] == [(0, 0.04), (1, 0.08)]
    assert [h["pressure"] for h in pressure[0]["history"]] == [0.0, 0.01, 0.02, 0.03, 0.04]
    assert [p["rank"] for p in cache_json(tmp_path, "pressure", "--rank", "1")["ranks"]] == [1]
    assert len(cache_json(tmp_path, "pressure", "--history", "2")["ranks"][0]["history"]) == 2

    log = cache_json(tmp_path, "evictions")["evictions"]
    assert [e["entry"] for e in log] == [1, 0]  # newest first
    assert log[0]["bytes"] == [100, 50] and log[0]["freed"] == 150
    assert log[0]["pressures"] == [0.1, 0.9] and log[0]["reason"] == "budget"
    ranked = cache_json(tmp_path, "evictions", "--rank", "1", "--limit", "1")["evictions"]
    assert len(ranked) == 1 and ranked[0]["freed"] == 50
    assert cache_json(tmp_path, "evictions", "--rank", "5")["evictions"] == []


def test_evictions_since(tmp_path: Path) -> None:
    populate(tmp_path, turns=5)
    db = sqlite3.connect(db_path(tmp_path))
    db.execute("UPDATE cache_events SET time = time - 7200 WHERE entry = 0 AND kind = 'evict'")
    db.commit()
    db.close()
    recent = cache_json(tmp_path, "evictions", "--since", "1h")["evictions"]
    assert [e["entry"] for e in recent] == [1]
    assert len(cache_json(tmp_path, "evictions", "--since", "3h")["evictions"]) == 2


@pytest.mark.parametrize(
    "args",
    [
        ["evictions", "--since", "bad"],
        ["evictions", "--since", "5 parsecs"],
        ["evictions", "--limit", "0"],
        ["evictions", "--rank", "-1"],
        ["pressure", "--history", "0"],
    ],
)
def test_bad_values_are_usage_errors(tmp_path: Path, args: list[str]) -> None:
    proc = exokv_text(tmp_path, "cache", *args)
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1
    assert proc.stderr.startswith("exokv: error:")


@pytest.mark.parametrize("command", COMMANDS)
def test_tables_render(tmp_path: Path, command: str) -> None:
    populate(tmp_path, turns=5)
    proc = exokv_text(tmp_path, "cache", command)
    assert proc.returncode == 0, proc.stderr
    assert "run " in proc.stdout or command == "evictions"
    assert "budget" in proc.stdout or command != "evictions"


def test_an_older_schema_is_migrated_by_a_reader(tmp_path: Path) -> None:
    db = sqlite3.connect(db_path(tmp_path))
    db.executescript(
        """
        CREATE TABLE schema_version (version INTEGER NOT NULL);
        INSERT INTO schema_version VALUES (1);
        CREATE TABLE sessions (id INTEGER PRIMARY KEY, name TEXT NOT NULL UNIQUE,
            model TEXT NOT NULL DEFAULT '', system TEXT, created REAL NOT NULL,
            last_used REAL NOT NULL);
        CREATE TABLE messages (session_id INTEGER NOT NULL, position INTEGER NOT NULL,
            role TEXT NOT NULL, content TEXT NOT NULL, PRIMARY KEY (session_id, position));
        CREATE TABLE turns (id INTEGER PRIMARY KEY, session_id INTEGER NOT NULL,
            turn INTEGER NOT NULL, prompt_tokens INTEGER NOT NULL, cached_tokens INTEGER NOT NULL,
            prefilled_tokens INTEGER NOT NULL, generated_tokens INTEGER NOT NULL,
            ttft_s REAL NOT NULL, decode_tps REAL NOT NULL, created REAL NOT NULL);
        CREATE TABLE cache_events (id INTEGER PRIMARY KEY, time REAL NOT NULL, kind TEXT NOT NULL,
            decision INTEGER NOT NULL, entry INTEGER NOT NULL, tokens INTEGER NOT NULL,
            bytes TEXT NOT NULL, session TEXT NOT NULL DEFAULT '',
            reason TEXT NOT NULL DEFAULT '');
        CREATE TABLE memory_samples (id INTEGER PRIMARY KEY, time REAL NOT NULL,
            rank INTEGER NOT NULL, pressure REAL NOT NULL, cache_bytes INTEGER NOT NULL,
            budget INTEGER, rss INTEGER NOT NULL, mlx_active INTEGER NOT NULL);
        INSERT INTO sessions VALUES (1, 'old', 'm', NULL, 1000.0, 1000.0);
        INSERT INTO turns VALUES (1, 1, 1, 50, 20, 30, 4, 0.1, 40.0, 1000.0);
        INSERT INTO cache_events VALUES (1, 1000.0, 'evict', 3, 7, 12, '[10,20]', 'old', 'lru');
        INSERT INTO memory_samples VALUES (1, 1000.0, 0, 0.4, 5, 100, 1, 1);
        """
    )
    db.close()
    assert cache_json(tmp_path, "stats")["total"]["tokens_saved"] == 20
    assert cache_json(tmp_path, "evictions")["evictions"][0]["reason"] == "lru"
    assert cache_json(tmp_path, "pressure")["ranks"][0]["pressure"] == 0.4
    for command in COMMANDS:
        assert exokv_text(tmp_path, "cache", command).returncode == 0


# -- damaged databases ----------------------------------------------------------


@pytest.mark.parametrize("damage", ["truncated", "random"])
@pytest.mark.parametrize("command", COMMANDS + ["clear"])
def test_a_damaged_database_is_one_line_exit_1_and_untouched(
    tmp_path: Path, damage: str, command: str
) -> None:
    populate(tmp_path / "good", turns=40)
    good = db_path(tmp_path / "good").read_bytes()
    content = good[: len(good) // 2] if damage == "truncated" else os.urandom(len(good))
    path = db_path(tmp_path / "bad")
    path.parent.mkdir()
    path.write_bytes(content)
    flag = "--yes" if command == "clear" else "--json"
    proc = exokv_text(tmp_path / "bad", "cache", command, flag)
    assert proc.returncode == 1
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert str(path) in lines[0] and "mv " in lines[0]
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    assert path.read_bytes() == content


# -- clear ------------------------------------------------------------------------


def test_clear_without_a_terminal_refuses(tmp_path: Path) -> None:
    populate(tmp_path)
    proc = exokv_text(tmp_path, "cache", "clear")
    assert proc.returncode == 1
    assert "--yes" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert cache_json(tmp_path, "stats")["total"]["entries"] == 3


def test_clear_yes_keeps_conversations(tmp_path: Path) -> None:
    populate(tmp_path)
    saved = caches_dir(tmp_path) / "s.safetensors"
    saved.parent.mkdir(parents=True)
    saved.write_bytes(b"kv")
    proc = exokv_text(tmp_path, "cache", "clear", "--yes", "--json")
    assert proc.returncode == 0, proc.stderr
    cleared = json.loads(proc.stdout)["cleared"]
    assert cleared == {"entries": 5, "events": 7, "samples": 10, "runs": 1, "saved_caches": 1}
    assert not caches_dir(tmp_path).exists()
    assert cache_json(tmp_path, "stats")["runs"] == []
    assert cache_json(tmp_path, "evictions")["evictions"] == []
    with Store.open(tmp_path) as store:
        assert store.load_messages("s") == [{"role": "user", "content": "4"}]
        assert store.get_system("s") == "sys"


def test_clear_refuses_while_a_chat_runs(tmp_path: Path) -> None:
    populate(tmp_path)
    with register_chat(tmp_path):
        proc = exokv_text(tmp_path, "cache", "clear", "--yes")
    assert proc.returncode == 1
    assert "chat is running" in proc.stderr and "quit" in proc.stderr
    assert cache_json(tmp_path, "stats")["total"]["entries"] == 3


def test_clear_on_an_empty_home(tmp_path: Path) -> None:
    proc = exokv_text(tmp_path / "home", "cache", "clear")
    assert proc.returncode == 0 and "Nothing to clear" in proc.stdout


@pytest.mark.parametrize(("answer", "cleared"), [("y\n", True), ("n\n", False), ("\n", False)])
def test_clear_asks_on_a_terminal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, answer: str, cleared: bool
) -> None:
    populate(tmp_path)
    monkeypatch.setenv("EXOKV_HOME", str(tmp_path))
    monkeypatch.setattr(cache_cli, "_stdin_is_interactive", lambda: True)
    result = CliRunner().invoke(cache_cli.cache_app, ["clear"], input=answer)
    assert "Delete the cache statistics" in result.output
    assert (result.exit_code == 0) is cleared
    assert (cache_json(tmp_path, "stats")["runs"] == []) is cleared


# -- readers while a writer writes ------------------------------------------------


def test_readers_see_whole_turns_while_a_writer_records(tmp_path: Path) -> None:
    turns = 50
    with Store.open(tmp_path) as store:
        run = store.start_run(MODEL, 2, [1000, 500])  # this process: a running run
    done = threading.Event()
    failures: list[str] = []
    seen: dict[str, list[int]] = {"exokv cache stats --json": [], "Store.stats": []}

    def writer() -> None:
        try:
            with Store.open(tmp_path) as store:
                for i in range(turns):
                    msgs = [{"role": "user", "content": f"turn {i}"}]
                    store.record_turn(run, "s", msgs, turn(i), MODEL)
                    time.sleep(0.06)
        except BaseException as err:  # noqa: BLE001 - reported below
            failures.append(f"writer: {err}")
        finally:
            done.set()

    def check(stats: dict, where: str) -> None:
        total = stats["total"]
        want = expected(total["turns"])
        got = {k: total[k] for k in want}
        if got != want:
            failures.append(f"{where}: half a turn? {got} != {want}")
        seen[where].append(total["turns"])

    def subprocess_reader() -> None:
        while not done.is_set():
            proc = exokv_text(tmp_path, "cache", "stats", "--json")
            if proc.returncode != 0 or proc.stderr:
                failures.append(f"reader exit {proc.returncode}: {proc.stderr.strip()}")
                return
            check(json.loads(proc.stdout), "exokv cache stats --json")

    def store_reader() -> None:
        with Store.open(tmp_path) as store:
            while not done.is_set():
                check(store.stats(), "Store.stats")

    threads = [threading.Thread(target=writer)]
    threads += [threading.Thread(target=subprocess_reader) for _ in range(3)]
    threads.append(threading.Thread(target=store_reader))
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    assert not failures, failures[:5]
    for where, counts in seen.items():
        assert any(0 < n < turns for n in counts), f"no {where} read overlapped the writes"
    final = cache_json(tmp_path, "stats")["total"]
    assert {k: final[k] for k in expected(turns)} == expected(turns)
