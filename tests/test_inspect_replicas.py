"""--replicas in the record: a turn's replica copies and each rank's replica bytes, through
the store to `exokv cache stats|pressure` (tables and --json), script mode's JSON, and
an older database upgraded. Fast: no ranks, the store filled with made-up turns."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
from typer.testing import CliRunner

from exokv.chat.conversation import Outcome
from exokv.chat.script import turn_json
from exokv.cli import cache as cache_cli
from exokv.core.records import RankStats, TurnResult
from exokv.core.sizes import format_size
from exokv.state import Store, db_path
from exokv.state.schema import LATEST, MIGRATIONS

MODEL = "builtin:tiny"
MB = 1_000_000
# (replica bytes, seconds) of each turn's copies: the first turn has nothing to copy yet.
COPIES = [(0, 0.0), (3 * MB, 0.5), (2 * MB, 0.25), (1 * MB, 1.0)]


def turn(i: int, copied: int = 0, seconds: float = 0.0, replicas: bool = True) -> TurnResult:
    # Two ranks, each host keeping the other's files: disk = own + the other's copies.
    own = [(i + 1) * MB, (i + 1) * MB // 2]
    kept = [own[1], own[0]] if replicas else [0, 0]
    result = TurnResult(
        session="s",
        reply="r",
        prompt_tokens=100,
        cached_tokens=10 * i,
        prefilled_tokens=100 - 10 * i,
        generated_tokens=8,
        ttft_s=0.01,
        decode_tps=50.0,
        overhead_s=0.0,
        ranks=2,
        decision=i,
        rank_stats=[
            RankStats(r, 1000, 1, 10_000, 0.1, 1 << 30, 1 << 20, 1 << 10, own[r] + kept[r])
            for r in range(2)
        ],
        replica_bytes=copied,
        replica_s=seconds,
    )
    for s in result.rank_stats:
        s.replica_bytes = kept[s.rank]
    return result


def populate(home: Path, replicas: bool = True) -> None:
    with Store.open(home) as store:
        run = store.start_run(MODEL, 2, [10_000, 10_000])
        store.ensure_session("s", MODEL)
        for i, (copied, seconds) in enumerate(COPIES):
            if not replicas:
                copied, seconds = 0, 0.0
            msgs = [{"role": "user", "content": str(i)}]
            store.record_turn(run, "s", msgs, turn(i, copied, seconds, replicas), MODEL)
        store.end_run(run)


def cache(monkeypatch: pytest.MonkeyPatch, home: Path, *args: str, width: int = 160) -> str:
    monkeypatch.setenv("EXOKV_HOME", str(home))
    monkeypatch.setenv("COLUMNS", str(width))
    result = CliRunner().invoke(cache_cli.cache_app, list(args))
    assert result.exit_code == 0, result.output
    return result.output


def test_replica_copies_reach_cache_stats(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    populate(tmp_path)
    total = json.loads(cache(monkeypatch, tmp_path, "stats", "--json"))["total"]
    assert total["replica_bytes"] == 6 * MB
    assert total["replica_s"] == 1.75
    assert total["replica_turns"] == 3
    # The median of 0.5, 0.25 and 1.0: the turn that copied nothing is left out.
    assert total["replica_median_s"] == 0.5
    assert total["turns"] == 4 and total["hits"] == 3  # the existing keys are kept
    text = cache(monkeypatch, tmp_path, "stats")
    assert "Replicas: 6.0 MB copied in 1.8 s over 3 turns; median 0.50 s a turn." in text


def test_single_host_stats_and_pressure_are_unchanged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    populate(tmp_path, replicas=False)
    total = json.loads(cache(monkeypatch, tmp_path, "stats", "--json"))["total"]
    assert (total["replica_bytes"], total["replica_s"], total["replica_turns"]) == (0, 0, 0)
    assert total["replica_median_s"] is None
    assert "Replicas" not in cache(monkeypatch, tmp_path, "stats")
    text = cache(monkeypatch, tmp_path, "pressure")
    assert "Disk" in text and "Replicas" not in text  # a disk tier on one host
    rows = json.loads(cache(monkeypatch, tmp_path, "pressure", "--json"))["ranks"]
    assert [(r["disk_bytes"], r["replica_bytes"]) for r in rows] == [(4 * MB, 0), (2 * MB, 0)]


def test_no_disk_tier_keeps_the_pressure_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with Store.open(tmp_path) as store:
        run = store.start_run(MODEL, 1, [10_000])
        stats = RankStats(0, 1000, 1, 10_000, 0.1, 1 << 30, 1 << 20, 1 << 10)
        result = TurnResult("s", "r", 10, 0, 10, 2, 0.01, 50.0, 0.0, 1, rank_stats=[stats])
        store.record_turn(run, "s", [{"role": "user", "content": "x"}], result, MODEL)
    text = cache(monkeypatch, tmp_path, "pressure")
    header = next(line for line in text.splitlines() if "Pressure" in line)
    assert "Disk" not in header and "Replicas" not in header


def test_pressure_shows_own_and_replica_disk_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    populate(tmp_path)
    rows = json.loads(cache(monkeypatch, tmp_path, "pressure", "--json"))["ranks"]
    # The last turn (i=3): rank 0 owns 4 MB and keeps rank 1's 2 MB, and the other way round.
    assert [(r["rank"], r["disk_bytes"], r["replica_bytes"]) for r in rows] == [
        (0, 6 * MB, 2 * MB),
        (1, 6 * MB, 4 * MB),
    ]
    text = cache(monkeypatch, tmp_path, "pressure")
    header = next(line for line in text.splitlines() if "Pressure" in line)
    assert "Disk" in header and "Replicas" in header
    line = next(line for line in text.splitlines() if line.strip().startswith("0 "))
    assert format_size(4 * MB) in line and format_size(2 * MB) in line
    # A narrow terminal drops them first.
    narrow = cache(monkeypatch, tmp_path, "pressure", width=80)
    assert "Replicas" in narrow.split("not shown at this width:")[1]
    assert all(len(line.rstrip()) <= 80 for line in narrow.splitlines())


def make_v8(home: Path) -> None:
    """A database as the exokv before replicas left it: schema 8, one turn sampled."""
    home.mkdir(parents=True, exist_ok=True)
    db = sqlite3.connect(db_path(home), isolation_level=None)
    db.execute("BEGIN")
    db.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
    for migration in MIGRATIONS[:8]:
        migration(db)
    db.execute("INSERT INTO schema_version VALUES (8)")
    db.execute("INSERT INTO runs (pid, model, ranks, started, ended) VALUES (0, 'm', 1, 1.0, 2.0)")
    db.execute("INSERT INTO sessions (name, model, created, last_used) VALUES ('old', 'm', 1, 1)")
    db.execute(
        "INSERT INTO turns (run_id, session_id, turn, prompt_tokens, cached_tokens, "
        "prefilled_tokens, generated_tokens, ttft_s, decode_tps, created) "
        "VALUES (1, 1, 1, 50, 20, 30, 4, 0.1, 40.0, 1.5)"
    )
    db.execute(
        "INSERT INTO memory_samples (run_id, turn_id, time, rank, pressure, cache_bytes, "
        "budget, rss, mlx_active, disk_bytes) VALUES (1, 1, 1.5, 0, 0.4, 5, 100, 1, 1, 700)"
    )
    db.execute("COMMIT")
    db.close()


def test_a_v8_database_gets_the_replica_columns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert LATEST >= 9
    make_v8(tmp_path)
    stats = json.loads(cache(monkeypatch, tmp_path, "stats", "--json"))
    assert stats["total"]["tokens_saved"] == 20
    assert stats["total"]["replica_bytes"] == 0 and stats["total"]["replica_median_s"] is None
    rows = json.loads(cache(monkeypatch, tmp_path, "pressure", "--json"))["ranks"]
    assert [(r["disk_bytes"], r["replica_bytes"]) for r in rows] == [(700, 0)]
    db = sqlite3.connect(db_path(tmp_path))
    assert db.execute("SELECT version FROM schema_version").fetchall() == [(LATEST,)]
    assert db.execute("SELECT replica_bytes, replica_s FROM turns").fetchall() == [(0, 0.0)]
    db.close()
    # The upgraded database takes the new figures with the next turn.
    with Store.open(tmp_path) as store:
        run = store.start_run(MODEL, 2, [None, None])
        store.record_turn(run, "old", [{"role": "user", "content": "y"}], turn(1, MB, 0.125), MODEL)
    db = sqlite3.connect(db_path(tmp_path))
    copies = db.execute("SELECT replica_bytes, replica_s FROM turns WHERE run_id = ?", (run,))
    assert copies.fetchall() == [(MB, 0.125)]
    samples = db.execute("SELECT replica_bytes FROM memory_samples WHERE run_id = ?", (run,))
    assert [r[0] for r in samples] == [MB, 2 * MB]
    db.close()


def test_script_json_has_the_replica_figures() -> None:
    result = turn(1, 3 * MB, 0.12345)
    doc = turn_json(Outcome(result=result, turn=2))
    keys = list(doc)
    assert keys[-2:] == ["replica_bytes", "replica_s"]  # appended after every existing key
    assert keys.index("rank_stats") == len(keys) - 3
    assert (doc["replica_bytes"], doc["replica_s"]) == (3 * MB, 0.123)
    assert "replica_error" not in doc
    assert [s["replica_bytes"] for s in doc["rank_stats"]] == [MB, 2 * MB]
    result.replica_error = "copy to host b failed: no space left"
    doc = turn_json(Outcome(result=result, turn=2))
    assert list(doc)[-1] == "replica_error" and doc["replica_error"] == result.replica_error
