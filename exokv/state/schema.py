"""The database schema as numbered migrations, applied in order on open.

A migration is a plain function of a connection that is already inside the
write transaction ``migrate`` opened, so a crash halfway leaves the previous
version intact. Never edit a released migration: add the next one.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable

from exokv.errors import ExokvError


def _script(db: sqlite3.Connection, sql: str) -> None:
    # Not executescript(): it commits the open transaction, and a migration must
    # stay all-or-nothing.
    for statement in sql.split(";"):
        if statement.strip():
            db.execute(statement)


def _v1(db: sqlite3.Connection) -> None:
    # The first shape: sessions and a flat cache log, before ranks ran as one "run".
    _script(
        db,
        """
        CREATE TABLE sessions (
            id INTEGER PRIMARY KEY,
            name TEXT NOT NULL UNIQUE,
            model TEXT NOT NULL DEFAULT '',
            system TEXT,
            created REAL NOT NULL,
            last_used REAL NOT NULL
        );
        CREATE TABLE messages (
            session_id INTEGER NOT NULL REFERENCES sessions(id) ON DELETE CASCADE,
            position INTEGER NOT NULL,
            role TEXT NOT NULL,
            content TEXT NOT NULL,
            PRIMARY KEY (session_id, position)
        );
        CREATE TABLE turns (
            id INTEGER PRIMARY KEY,
            session_id INTEGER NOT NULL REFERENCES sessions(id) ON DELETE CASCADE,
            turn INTEGER NOT NULL,
            prompt_tokens INTEGER NOT NULL,
            cached_tokens INTEGER NOT NULL,
            prefilled_tokens INTEGER NOT NULL,
            generated_tokens INTEGER NOT NULL,
            ttft_s REAL NOT NULL,
            decode_tps REAL NOT NULL,
            created REAL NOT NULL
        );
        CREATE TABLE cache_events (
            id INTEGER PRIMARY KEY,
            time REAL NOT NULL,
            kind TEXT NOT NULL,
            decision INTEGER NOT NULL,
            entry INTEGER NOT NULL,
            tokens INTEGER NOT NULL,
            bytes TEXT NOT NULL,
            session TEXT NOT NULL DEFAULT '',
            reason TEXT NOT NULL DEFAULT ''
        );
        CREATE TABLE memory_samples (
            id INTEGER PRIMARY KEY,
            time REAL NOT NULL,
            rank INTEGER NOT NULL,
            pressure REAL NOT NULL,
            cache_bytes INTEGER NOT NULL,
            budget INTEGER,
            rss INTEGER NOT NULL,
            mlx_active INTEGER NOT NULL
        );
        """,
    )


def _v2(db: sqlite3.Connection) -> None:
    # Long for its SQL (55 of its lines), kept whole: a migration runs as it shipped.
    # Tree node ids restart in every chat process, so entries and events are
    # scoped to a run (one chat process); v1 rows are adopted by a "legacy" run.
    _script(
        db,
        """
        CREATE TABLE runs (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            pid INTEGER NOT NULL,
            host TEXT NOT NULL DEFAULT '',
            model TEXT NOT NULL DEFAULT '',
            ranks INTEGER NOT NULL DEFAULT 1,
            budgets TEXT NOT NULL DEFAULT '[]',
            started REAL NOT NULL,
            ended REAL
        );
        ALTER TABLE turns ADD COLUMN run_id INTEGER REFERENCES runs(id) ON DELETE SET NULL;
        ALTER TABLE turns ADD COLUMN model TEXT NOT NULL DEFAULT '';
        ALTER TABLE turns ADD COLUMN overhead_s REAL NOT NULL DEFAULT 0;
        ALTER TABLE turns ADD COLUMN evictions INTEGER NOT NULL DEFAULT 0;
        ALTER TABLE turns ADD COLUMN decision INTEGER NOT NULL DEFAULT 0;
        ALTER TABLE turns ADD COLUMN finish_reason TEXT NOT NULL DEFAULT '';
        ALTER TABLE cache_events ADD COLUMN run_id INTEGER REFERENCES runs(id) ON DELETE CASCADE;
        ALTER TABLE cache_events ADD COLUMN turn_id INTEGER REFERENCES turns(id) ON DELETE SET NULL;
        ALTER TABLE cache_events ADD COLUMN pressures TEXT NOT NULL DEFAULT '[]';
        ALTER TABLE cache_events ADD COLUMN hit_length INTEGER NOT NULL DEFAULT 0;
        ALTER TABLE memory_samples ADD COLUMN run_id INTEGER REFERENCES runs(id) ON DELETE CASCADE;
        ALTER TABLE memory_samples ADD COLUMN turn_id INTEGER
            REFERENCES turns(id) ON DELETE SET NULL;
        ALTER TABLE memory_samples ADD COLUMN entries INTEGER NOT NULL DEFAULT 0;
        ALTER TABLE memory_samples ADD COLUMN ram_total INTEGER NOT NULL DEFAULT 0;
        CREATE TABLE cache_entries (
            run_id INTEGER NOT NULL REFERENCES runs(id) ON DELETE CASCADE,
            node_id INTEGER NOT NULL,
            parent INTEGER,
            session TEXT NOT NULL DEFAULT '',
            model TEXT NOT NULL DEFAULT '',
            tokens INTEGER NOT NULL,
            depth INTEGER NOT NULL,
            bytes TEXT NOT NULL,
            hits INTEGER NOT NULL DEFAULT 0,
            tick INTEGER NOT NULL DEFAULT 0,
            created REAL NOT NULL,
            last_used REAL NOT NULL,
            evicted_at REAL,
            PRIMARY KEY (run_id, node_id)
        );
        CREATE INDEX turns_run ON turns(run_id);
        CREATE INDEX turns_session ON turns(session_id, turn);
        CREATE INDEX events_run_kind ON cache_events(run_id, kind);
        CREATE INDEX events_kind_time ON cache_events(kind, time);
        CREATE INDEX samples_run_rank ON memory_samples(run_id, rank, id);
        """,
    )
    row = db.execute(
        """
        SELECT MIN(t), MAX(t), MAX(r) FROM (
            SELECT time AS t, NULL AS r FROM cache_events
            UNION ALL SELECT time, rank FROM memory_samples
            UNION ALL SELECT created, NULL FROM turns
        )
        """
    ).fetchone()
    if row[0] is None:
        return
    ranks = (row[2] if row[2] is not None else 0) + 1
    cur = db.execute(
        "INSERT INTO runs (pid, model, ranks, started, ended) VALUES (0, 'legacy', ?, ?, ?)",
        (ranks, row[0], row[1]),
    )
    for table in ("turns", "cache_events", "memory_samples"):
        db.execute(f"UPDATE {table} SET run_id = ?", (cur.lastrowid,))


def _v3(db: sqlite3.Connection) -> None:
    # An assistant message's exact generated token ids (a JSON list of ints), written
    # in the turn's transaction: a resumed chat renders each earlier reply as the
    # tokens the model produced. NULL: not known (older rows, user and system lines).
    db.execute("ALTER TABLE messages ADD COLUMN tokens TEXT")


def _v4_session_options(db: sqlite3.Connection) -> None:
    # A session remembers the --max-kv-size it was started with (its model and system
    # prompt already have columns), so resuming it without flags keeps its settings.
    # NULL: not given (an unbounded KV cache) or written by an older exokv.
    db.execute("ALTER TABLE sessions ADD COLUMN max_kv_size INTEGER")


def _v5_disk_tier(db: sqlite3.Connection) -> None:
    # The disk tier (exokv.cache.disk_tier): where each entry is, and each rank's disk bytes.
    _script(
        db,
        """
        ALTER TABLE cache_entries ADD COLUMN tier TEXT NOT NULL DEFAULT 'ram';
        ALTER TABLE memory_samples ADD COLUMN disk_bytes INTEGER NOT NULL DEFAULT 0;
        ALTER TABLE memory_samples ADD COLUMN disk_budget INTEGER
        """,
    )


def _v6_pins(db: sqlite3.Connection) -> None:
    # /pin: a pinned session's cache entries are evicted after every other's. Kept
    # here, so a pin outlives the chat that set it.
    db.execute("ALTER TABLE sessions ADD COLUMN pinned INTEGER NOT NULL DEFAULT 0")


def _v7_chat_template(db: sqlite3.Connection) -> None:
    # A session keeps its --chat-template: a built-in's name or a template file's Jinja
    # text (kept, not the path: the file may move). NULL: the model's own template.
    db.execute("ALTER TABLE sessions ADD COLUMN chat_template TEXT")


def _v8_speculation(db: sqlite3.Connection) -> None:
    # Speculative decoding (exokv.rank.speculate): a turn's draft tokens the model
    # checked and those it kept, for the acceptance rate of /stats and cache stats.
    _script(
        db,
        """
        ALTER TABLE turns ADD COLUMN draft_tokens INTEGER NOT NULL DEFAULT 0;
        ALTER TABLE turns ADD COLUMN accepted_tokens INTEGER NOT NULL DEFAULT 0
        """,
    )


def _v9_replicas(db: sqlite3.Connection) -> None:
    # --replicas: the replica copies that ended with a turn (their bytes and seconds),
    # and of each rank's disk bytes, the copies of other ranks' files its host keeps;
    # the hosts a run's ranks ran on (a session resumed on other hosts asks them for
    # the KV files of its layers: exokv.client.replan.spread_kv).
    _script(
        db,
        """
        ALTER TABLE turns ADD COLUMN replica_bytes INTEGER NOT NULL DEFAULT 0;
        ALTER TABLE turns ADD COLUMN replica_s REAL NOT NULL DEFAULT 0;
        ALTER TABLE memory_samples ADD COLUMN replica_bytes INTEGER NOT NULL DEFAULT 0;
        ALTER TABLE runs ADD COLUMN hosts TEXT NOT NULL DEFAULT '[]'
        """,
    )


MIGRATIONS: list[Callable[[sqlite3.Connection], None]] = [
    _v1,
    _v2,
    _v3,
    _v4_session_options,
    _v5_disk_tier,
    _v6_pins,
    _v7_chat_template,
    _v8_speculation,
    _v9_replicas,
]
LATEST = len(MIGRATIONS)


def current_version(db: sqlite3.Connection) -> int:
    has_table = db.execute(
        "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'schema_version'"
    ).fetchone()
    if not has_table:
        return 0
    row = db.execute("SELECT MAX(version) FROM schema_version").fetchone()
    return int(row[0] or 0)


def foreign_tables(db: sqlite3.Connection) -> list[str]:
    """Tables of a database that has no exokv version: someone else's file."""
    if current_version(db) != 0:
        return []
    rows = db.execute("SELECT name FROM sqlite_master WHERE type = 'table'").fetchall()
    return [r[0] for r in rows if not r[0].startswith("sqlite_")]


def migrate(db: sqlite3.Connection, where: str) -> int:
    """Bring the schema to LATEST; returns the version found before migrating.

    Runs under BEGIN IMMEDIATE and re-reads the version inside it, so two
    processes opening an old database at once migrate it exactly once.
    """
    if current_version(db) == LATEST:
        return LATEST
    db.execute("BEGIN IMMEDIATE")
    try:
        found = current_version(db)
        if found > LATEST:
            raise ExokvError(
                f"{where} was written by a newer exokv (schema {found}, this one knows "
                f"{LATEST}): upgrade exokv"
            )
        db.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
        for version in range(found + 1, LATEST + 1):
            MIGRATIONS[version - 1](db)
            db.execute("DELETE FROM schema_version")
            db.execute("INSERT INTO schema_version (version) VALUES (?)", (version,))
        db.execute("COMMIT")
    except BaseException:
        db.execute("ROLLBACK")
        raise
    return found
