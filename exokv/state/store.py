"""Writing to and reading from the one SQLite database (opened by exokv.state.connection).

Writers take the write lock up front (BEGIN IMMEDIATE) so a read never has to
be upgraded, and each chat turn is one transaction; readers run in WAL mode
inside one read transaction, so they see whole turns and never block the chat.
"""

from __future__ import annotations

import json
import operator
import os
import shutil
import signal
import socket
import sqlite3
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from exokv.config import exokv_home
from exokv.core.records import CacheEvent, EntryInfo, RankStats, TurnResult
from exokv.errors import ExokvError
from exokv.state import queries
from exokv.state.connection import connect, db_path, guarded


def caches_dir(home: Path | None = None) -> Path:
    """Where the disk tier keeps KV (exokv.cache.tier_options); `exokv cache clear` empties it."""
    return (home if home is not None else exokv_home()) / "kv"


@contextmanager
def _wake_signal_held() -> Iterator[None]:
    """Hold back SIGUSR1 (how a chat's watcher ends the chat when its ranks are lost, see
    exokv.client.cluster) until a write transaction is over: a turn that finished is
    stored whole, then the chat ends."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


def _dump_tokens(role: str, tokens: Sequence[int] | None) -> str | None:
    """A message's token ids as stored: a JSON list of ints, or NULL for none."""
    if tokens is None:
        return None
    if role != "assistant":
        raise ValueError(f"only assistant messages carry token ids (got a {role!r} message)")
    try:
        if isinstance(tokens, (str, bytes)):
            raise TypeError
        ids = [operator.index(t) for t in tokens]
    except TypeError:
        raise ValueError(f"a message's tokens must be a list of ints, not {tokens!r}") from None
    return _dumps(ids) if ids else None


def _load_tokens(raw: str | None) -> list[int] | None:
    # A value that is not a list of ints is treated as absent: the reply is then
    # encoded again from its text, which costs cache hits but never a wrong prompt.
    if raw is None:
        return None
    try:
        value = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(value, list) or not value:
        return None
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return None
    return value


class Store:
    """The exokv database. Open with ``Store.open()``; use as a context manager to close."""

    def __init__(self, db: sqlite3.Connection, path: Path) -> None:
        self._db = db
        self.path = path
        self.home = path.parent
        self._lock = threading.RLock()

    # -- opening ---------------------------------------------------------

    @classmethod
    def open(cls, home: Path | None = None) -> Store:
        """Open (creating and migrating as needed) the database under ``home``."""
        path = db_path(home)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise ExokvError(
                f"cannot create {path.parent}: {err.strerror}; "
                "set EXOKV_HOME to a writable directory"
            ) from err
        return cls(connect(path), path)

    @classmethod
    def open_existing(cls, home: Path | None = None) -> Store | None:
        """Like ``open`` but None when there is no database yet: readers create nothing.

        On a read-only home (a read-only mount, a backup) the database is opened
        read-only, so the reading commands work; a write then fails with one line.
        """
        path = db_path(home)
        if not path.exists():
            return None
        return cls(connect(path, read_only_ok=True), path)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- transactions ----------------------------------------------------

    @contextmanager
    def _guard(self) -> Iterator[None]:
        with guarded(self.path):
            yield

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        with self._lock, self._guard(), _wake_signal_held():
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
                self._db.execute("COMMIT")
            except BaseException:
                # SQLite may already have rolled back (e.g. disk full).
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                raise

    @contextmanager
    def snapshot(self) -> Iterator[sqlite3.Connection]:
        """One read transaction: every query inside sees the same whole turns."""
        with self._lock, self._guard():
            if self._db.in_transaction:
                yield self._db
                return
            self._db.execute("BEGIN")
            try:
                yield self._db
            finally:
                self._db.execute("COMMIT")

    # -- runs --------------------------------------------------------------

    def start_run(
        self, model: str, ranks: int, budgets: list[int | None], hosts: Sequence[str] = ()
    ) -> int:
        """One row per chat process; cache entries and events belong to it. `hosts`: the
        ssh names its ranks run on (none on this machine alone)."""
        with self._write() as db:
            cur = db.execute(
                "INSERT INTO runs (pid, host, model, ranks, budgets, started, hosts) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                (
                    os.getpid(),
                    socket.gethostname(),
                    model,
                    ranks,
                    _dumps(budgets),
                    time.time(),
                    _dumps(list(hosts)),
                ),
            )
            return int(cur.lastrowid)

    def set_run_hosts(self, run_id: int, hosts: Sequence[str]) -> None:
        """The hosts the run's ranks run on now (a re-plan changed them)."""
        with self._write() as db:
            db.execute("UPDATE runs SET hosts = ? WHERE id = ?", (_dumps(list(hosts)), run_id))

    def last_hosts(self, session: str) -> list[str]:
        """The hosts the latest run with a turn of `session` ran on ([] on one machine)."""
        with self.snapshot() as db:
            row = db.execute(
                "SELECT r.hosts FROM turns t JOIN runs r ON r.id = t.run_id "
                "JOIN sessions s ON s.id = t.session_id WHERE s.name = ? "
                "ORDER BY t.id DESC LIMIT 1",
                (session,),
            ).fetchone()
        try:
            hosts = json.loads(row[0]) if row else []
        except (TypeError, ValueError):
            return []
        return [str(h) for h in hosts] if isinstance(hosts, list) else []

    def end_run(self, run_id: int) -> None:
        with self._write() as db:
            db.execute(
                "UPDATE runs SET ended = ? WHERE id = ? AND ended IS NULL", (time.time(), run_id)
            )

    # -- sessions and messages -------------------------------------------

    def _session_id(self, db: sqlite3.Connection, name: str, model: str | None, now: float) -> int:
        db.execute(
            "INSERT INTO sessions (name, model, created, last_used) VALUES (?, ?, ?, ?) "
            "ON CONFLICT(name) DO UPDATE SET last_used = excluded.last_used, "
            "model = CASE WHEN excluded.model != '' THEN excluded.model ELSE sessions.model END",
            (name, model or "", now, now),
        )
        return int(db.execute("SELECT id FROM sessions WHERE name = ?", (name,)).fetchone()[0])

    def ensure_session(self, name: str, model: str, system: str | None = None) -> None:
        """Create the session if new, else mark it used; a ``system`` replaces its prompt."""
        with self._write() as db:
            sid = self._session_id(db, name, model, time.time())
            if system is not None:
                db.execute("UPDATE sessions SET system = ? WHERE id = ?", (system, sid))

    def session_names(self) -> list[str]:
        with self.snapshot() as db:
            return [r[0] for r in db.execute("SELECT name FROM sessions ORDER BY last_used DESC")]

    def sessions(self) -> list[dict[str, Any]]:
        with self.snapshot() as db:
            return queries.sessions(db)

    def get_system(self, session: str) -> str | None:
        with self.snapshot() as db:
            row = db.execute("SELECT system FROM sessions WHERE name = ?", (session,)).fetchone()
            return row[0] if row else None

    def load_messages(self, session: str, with_tokens: bool = False) -> list[dict[str, Any]]:
        """The conversation in order, as ``{"role", "content"}`` dicts.

        With ``with_tokens``, assistant messages whose generated token ids are stored
        also carry them as ``"tokens"`` (a list of ints); the result can be given back
        to ``set_messages`` as it is.
        """
        with self.snapshot() as db:
            rows = db.execute(
                "SELECT m.role, m.content, m.tokens FROM messages m "
                "JOIN sessions s ON s.id = m.session_id WHERE s.name = ? ORDER BY m.position",
                (session,),
            ).fetchall()
        messages: list[dict[str, Any]] = []
        for role, content, raw in rows:
            message: dict[str, Any] = {"role": role, "content": content}
            if with_tokens and (tokens := _load_tokens(raw)) is not None:
                message["tokens"] = tokens
            messages.append(message)
        return messages

    def load_reply_tokens(self, session: str) -> list[tuple[str, list[int]]]:
        """``(reply, token ids)`` of the session's assistant messages that have them, in order.

        What the server gives a request's replies that come as text alone
        (exokv.serve.replies), so each renders as the tokens generated. Replies without
        stored tokens are left out.
        """
        return [
            (m["content"], m["tokens"])
            for m in self.load_messages(session, with_tokens=True)
            if m["role"] == "assistant" and "tokens" in m
        ]

    @staticmethod
    def _append_turn(
        db: sqlite3.Connection, sid: int, messages: Sequence[Mapping[str, Any]]
    ) -> None:
        """Write only what the turn added, after what is stored; never rewrite a turn.

        The stored messages that `messages` starts with stay as they are (rows and
        tokens); the rest of `messages` goes after the last stored message. The one
        exception is /retry: `messages` is the stored conversation with its last reply
        replaced, and only that reply is replaced. A writer whose copy is out of date
        (another chat added turns meanwhile; exokv.state.locks prevents that for chats)
        therefore adds its turn at the end and loses nobody's.
        """
        stored = db.execute(
            "SELECT role, content FROM messages WHERE session_id = ? ORDER BY position", (sid,)
        ).fetchall()
        common = 0
        for (role, content), m in zip(stored, messages, strict=False):
            if (role, content) != (m["role"], m["content"]):
                break
            common += 1
        at = len(stored)
        new = list(messages[common:])
        if at == common + 1 == len(messages) and stored[-1][0] == messages[-1]["role"]:
            at = common  # /retry: the last reply, generated again
            db.execute("DELETE FROM messages WHERE session_id = ? AND position = ?", (sid, at))
        elif common < at:
            # An out-of-date copy: only its last exchange is this turn's.
            users = [i for i, m in enumerate(messages) if m["role"] == "user"]
            new = list(messages[users[-1] :] if users else messages[-1:])
        db.executemany(
            "INSERT INTO messages (session_id, position, role, content, tokens) "
            "VALUES (?, ?, ?, ?, ?)",
            [
                (sid, i, m["role"], m["content"], _dump_tokens(m["role"], m.get("tokens")))
                for i, m in enumerate(new, start=at)
            ],
        )

    @staticmethod
    def _replace_messages(
        db: sqlite3.Connection, sid: int, messages: Sequence[Mapping[str, Any]]
    ) -> None:
        # An assistant message without a "tokens" key keeps the tokens stored for the
        # same reply text (a caller's copy may lack them), so a caller
        # that only edits the list (/undo, /system) loses none; "tokens": None drops them.
        kept = {
            r[0]: r[1]
            for r in db.execute(
                "SELECT content, tokens FROM messages "
                "WHERE session_id = ? AND role = 'assistant' AND tokens IS NOT NULL",
                (sid,),
            )
        }
        rows = []
        for i, m in enumerate(messages):
            if "tokens" in m:
                tokens = _dump_tokens(m["role"], m["tokens"])
            else:
                tokens = kept.get(m["content"]) if m["role"] == "assistant" else None
            rows.append((sid, i, m["role"], m["content"], tokens))
        db.execute("DELETE FROM messages WHERE session_id = ?", (sid,))
        db.executemany(
            "INSERT INTO messages (session_id, position, role, content, tokens) "
            "VALUES (?, ?, ?, ?, ?)",
            rows,
        )

    def set_messages(self, session: str, messages: Sequence[Mapping[str, Any]]) -> None:
        """Replace the whole conversation (for /undo, /retry, /system).

        A message may carry ``"tokens"``: an assistant reply's generated token ids,
        stored in the same transaction (see ``_replace_messages`` for one without).
        """
        with self._write() as db:
            self._replace_messages(db, self._session_id(db, session, None, time.time()), messages)

    # -- session metadata, rename, remove ------------------------------------

    def session_info(self, session: str) -> dict[str, Any] | None:
        """A session's stored settings and counts (as ``sessions()`` rows), or None."""
        with self.snapshot() as db:
            return next((r for r in queries.sessions(db, session) if r["name"] == session), None)

    def set_session_options(
        self, session: str, max_kv_size: int | None, chat_template: str | None = None
    ) -> None:
        """Remember the session's ``--max-kv-size`` and ``--chat-template`` (a built-in's
        name or a file's Jinja text; None: the model's own) (the session must exist)."""
        with self._write() as db:
            db.execute(
                "UPDATE sessions SET max_kv_size = ?, chat_template = ? WHERE name = ?",
                (max_kv_size, chat_template, session),
            )

    def set_pinned(self, session: str, pinned: bool) -> bool:
        """Pin or unpin a stored session; False if there is no such session."""
        with self._write() as db:
            cur = db.execute(
                "UPDATE sessions SET pinned = ? WHERE name = ?", (int(pinned), session)
            )
            return cur.rowcount > 0

    def pinned_sessions(self) -> list[str]:
        with self.snapshot() as db:
            rows = db.execute("SELECT name FROM sessions WHERE pinned ORDER BY name")
            return [r[0] for r in rows]

    def rename_session(self, old: str, new: str) -> None:
        """Rename a session; its saved KV cache directory follows it on this machine."""
        with self._write() as db:
            if db.execute("SELECT 1 FROM sessions WHERE name = ?", (new,)).fetchone():
                raise ExokvError(f"a session named {new!r} exists already")
            cur = db.execute("UPDATE sessions SET name = ? WHERE name = ?", (new, old))
            if cur.rowcount == 0:
                raise ExokvError(f"no session {old!r}: `exokv sessions list` shows them")
            db.execute("UPDATE cache_entries SET session = ? WHERE session = ?", (new, old))
            db.execute("UPDATE cache_events SET session = ? WHERE session = ?", (new, old))

    def delete_session(self, session: str) -> int:
        """Delete a session with its messages and turns; returns how many messages went."""
        with self._write() as db:
            row = db.execute("SELECT id FROM sessions WHERE name = ?", (session,)).fetchone()
            if row is None:
                raise ExokvError(f"no session {session!r}: `exokv sessions list` shows them")
            count = db.execute(
                "SELECT COUNT(*) FROM messages WHERE session_id = ?", (row[0],)
            ).fetchone()[0]
            db.execute("DELETE FROM sessions WHERE id = ?", (row[0],))
        return int(count)

    # -- the cache ---------------------------------------------------------

    @staticmethod
    def _insert_events(
        db: sqlite3.Connection,
        run_id: int,
        turn_id: int | None,
        events: Iterable[CacheEvent],
        now: float,
    ) -> None:
        for e in events:
            db.execute(
                "INSERT INTO cache_events (run_id, turn_id, time, kind, decision, entry, tokens, "
                "bytes, session, reason, pressures, hit_length) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    run_id,
                    turn_id,
                    now,
                    e.kind,
                    e.decision,
                    e.entry,
                    e.tokens,
                    _dumps(list(e.bytes)),
                    e.session,
                    e.reason,
                    _dumps(list(e.pressures)),
                    e.hit_length,
                ),
            )
            if e.kind in ("evict", "drop"):  # drop: off the disk tier, out of the tree
                db.execute(
                    "UPDATE cache_entries SET evicted_at = ? "
                    "WHERE run_id = ? AND node_id = ? AND evicted_at IS NULL",
                    (now, run_id, e.entry),
                )
            elif e.kind == "clear":
                db.execute(
                    "UPDATE cache_entries SET evicted_at = ? "
                    "WHERE run_id = ? AND evicted_at IS NULL",
                    (now, run_id),
                )

    @staticmethod
    def _upsert_entries(
        db: sqlite3.Connection, run_id: int, model: str, entries: Iterable[EntryInfo], now: float
    ) -> None:
        # last_used is wall time, moved only when the tree's own clock or hit count moved.
        db.executemany(
            "INSERT INTO cache_entries (run_id, node_id, parent, session, model, tokens, depth, "
            "bytes, hits, tick, created, last_used, evicted_at, tier) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, NULL, ?) "
            "ON CONFLICT(run_id, node_id) DO UPDATE SET parent = excluded.parent, "
            "session = excluded.session, tokens = excluded.tokens, depth = excluded.depth, "
            "bytes = excluded.bytes, hits = excluded.hits, "
            "last_used = CASE WHEN excluded.tick != cache_entries.tick "
            "OR excluded.hits != cache_entries.hits "
            "THEN excluded.last_used ELSE cache_entries.last_used END, "
            "tick = excluded.tick, evicted_at = NULL, tier = excluded.tier",
            [
                (
                    run_id,
                    e.id,
                    e.parent,
                    e.session,
                    model,
                    e.tokens,
                    e.depth,
                    _dumps(list(e.bytes)),
                    e.hits,
                    e.last_used,
                    now,
                    now,
                    e.tier,
                )
                for e in entries
            ],
        )

    @staticmethod
    def _insert_samples(
        db: sqlite3.Connection,
        run_id: int,
        turn_id: int | None,
        stats: Iterable[RankStats],
        now: float,
    ) -> None:
        db.executemany(
            "INSERT INTO memory_samples (run_id, turn_id, time, rank, pressure, cache_bytes, "
            "entries, budget, rss, mlx_active, ram_total, disk_bytes, disk_budget, "
            "replica_bytes) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            [
                (
                    run_id,
                    turn_id,
                    now,
                    s.rank,
                    s.pressure,
                    s.cache_bytes,
                    s.entries,
                    s.budget,
                    s.rss,
                    s.mlx_active,
                    s.ram_total,
                    s.disk_bytes,
                    s.disk_budget,
                    s.replica_bytes,
                )
                for s in stats
            ],
        )

    def record_turn(
        self,
        run_id: int,
        session: str,
        messages: Sequence[Mapping[str, Any]],
        result: TurnResult,
        model: str,
        turn: int | None = None,
    ) -> int:
        """Store one whole turn atomically; returns its number in the session.

        ``messages`` is the conversation after the turn; only what it adds to the stored
        one is written (see ``_append_turn``). An assistant message may carry
        ``"tokens"``, its generated token ids (as for ``set_messages``), written in the
        same transaction. ``result.entries`` is the tree's live entries after the turn
        (entries it omits are left as they were; only ``evict``/``clear`` events end an
        entry).
        """
        now = time.time()
        with self._write() as db:
            sid = self._session_id(db, session, model, now)
            self._append_turn(db, sid, messages)
            if turn is None:
                turn = int(
                    db.execute(
                        "SELECT COALESCE(MAX(turn), 0) + 1 FROM turns WHERE session_id = ?", (sid,)
                    ).fetchone()[0]
                )
            cur = db.execute(
                "INSERT INTO turns (run_id, session_id, turn, model, prompt_tokens, cached_tokens, "
                "prefilled_tokens, generated_tokens, ttft_s, decode_tps, overhead_s, evictions, "
                "decision, finish_reason, created, draft_tokens, accepted_tokens, replica_bytes, "
                "replica_s) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    run_id,
                    sid,
                    turn,
                    model,
                    result.prompt_tokens,
                    result.cached_tokens,
                    result.prefilled_tokens,
                    result.generated_tokens,
                    result.ttft_s,
                    result.decode_tps,
                    result.overhead_s,
                    result.evictions,
                    result.decision,
                    result.finish_reason,
                    now,
                    result.draft_tokens,
                    result.accepted_tokens,
                    result.replica_bytes,
                    result.replica_s,
                ),
            )
            turn_id = cur.lastrowid
            self._insert_events(db, run_id, turn_id, result.events, now)
            self._upsert_entries(db, run_id, model, result.entries, now)
            self._insert_samples(db, run_id, turn_id, result.rank_stats, now)
        return turn

    def record_events(self, run_id: int, events: list[CacheEvent]) -> None:
        """Events outside a turn, e.g. ``clear`` from /new or a cache reload."""
        with self._write() as db:
            self._insert_events(db, run_id, None, events, time.time())

    def record_samples(self, run_id: int, stats: list[RankStats]) -> None:
        """Memory samples outside a turn, e.g. right after the ranks start."""
        with self._write() as db:
            self._insert_samples(db, run_id, None, stats, time.time())

    # -- reading -----------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        with self.snapshot() as db:
            return queries.stats(db)

    def entries(self, session: str | None = None) -> list[dict[str, Any]]:
        with self.snapshot() as db:
            return queries.entries(db, session)

    def pressure(self, rank: int | None = None, history: int = 30) -> list[dict[str, Any]]:
        with self.snapshot() as db:
            return queries.pressure(db, rank, history)

    def evictions(
        self, rank: int | None = None, limit: int = 20, since: float | None = None
    ) -> list[dict[str, Any]]:
        with self.snapshot() as db:
            return queries.evictions(db, rank, limit, since)

    def clear(self) -> dict[str, int]:
        """Forget the cache (entries, events, samples, runs, saved KV caches).

        Sessions, messages and turns stay: conversations are never lost. Turns
        lose their run, so cache statistics start again from zero.
        """
        tables = {"entries": "cache_entries", "events": "cache_events", "samples": "memory_samples"}
        tables["runs"] = "runs"
        with self._write() as db:
            before = {
                k: db.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0] for k, t in tables.items()
            }
            # A run still running keeps its rows: its next turn references them.
            keep = [r["id"] for r in db.execute("SELECT * FROM runs") if queries.run_is_running(r)]
            # NOT IN over json_each: an empty list keeps nothing (NOT IN (NULL) would keep all).
            keep_json = _dumps(keep)
            db.execute(
                "UPDATE turns SET run_id = NULL "
                "WHERE run_id NOT IN (SELECT value FROM json_each(?))",
                (keep_json,),
            )
            db.execute(
                "DELETE FROM runs WHERE id NOT IN (SELECT value FROM json_each(?))", (keep_json,)
            )
            db.execute("DELETE FROM cache_events WHERE run_id IS NULL")
            db.execute("DELETE FROM memory_samples WHERE run_id IS NULL")
            after = {
                k: db.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0] for k, t in tables.items()
            }
        counts = {k: before[k] - after[k] for k in tables}
        counts["saved_caches"] = clear_saved_caches(self.home)
        return counts


def clear_saved_caches(home: Path | None = None) -> int:
    """Delete the disk tier's KV (and caches/, where earlier versions kept a file per session);
    returns how many files went."""
    count = 0
    for directory in (caches_dir(home), (home if home is not None else exokv_home()) / "caches"):
        if directory.is_dir():
            count += sum(1 for p in directory.rglob("*") if p.is_file())
            shutil.rmtree(directory)
    return count
