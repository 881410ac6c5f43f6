"""The SQLite store: schema and migrations, sessions, whole turns, the cache log, corruption."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from exokv.core.records import CacheEvent, EntryInfo, RankStats, TurnRequest, TurnResult
from exokv.errors import ExokvError
from exokv.state import Store, caches_dir, db_path, register_chat, running_chats
from exokv.state.schema import LATEST
from tests.stub_client import StubClient

MODEL = "builtin:tiny"


def turn_result(
    session: str = "s",
    cached: int = 0,
    events: list[CacheEvent] | None = None,
    entries: list[EntryInfo] | None = None,
    pressures: tuple[float, ...] = (0.5, 0.7),
    cache_bytes: tuple[int, ...] = (1000, 500),
) -> TurnResult:
    return TurnResult(
        session=session,
        reply="ok",
        prompt_tokens=100,
        cached_tokens=cached,
        prefilled_tokens=100 - cached,
        generated_tokens=8,
        ttft_s=0.01,
        decode_tps=100.0,
        overhead_s=0.001,
        ranks=len(pressures),
        decision=1,
        events=events or [],
        entries=entries or [],
        rank_stats=[
            RankStats(r, cache_bytes[r], len(entries or []), 10_000, p, 16 << 30, 1 << 30, 1 << 20)
            for r, p in enumerate(pressures)
        ],
    )


def add(entry: int, tokens: int = 10, size: tuple[int, int] = (100, 50)) -> CacheEvent:
    return CacheEvent("add", 1, entry, tokens, list(size), "s")


def evict(entry: int, tokens: int = 10, size: tuple[int, int] = (100, 50)) -> CacheEvent:
    return CacheEvent("evict", 2, entry, tokens, list(size), "s", "budget", [0.5, 0.95])


def info(entry: int, tokens: int = 10, size: tuple[int, int] = (100, 50), hits: int = 0):
    return EntryInfo(entry, None, "s", tokens, 1, list(size), hits, entry)


MESSAGES = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]


@pytest.fixture
def store(tmp_path: Path):
    with Store.open(tmp_path) as s:
        yield s


def test_open_creates_a_wal_database_at_the_latest_version(tmp_path: Path) -> None:
    with Store.open(tmp_path / "new" / "home") as s:
        assert s.path == db_path(tmp_path / "new" / "home")
    db = sqlite3.connect(db_path(tmp_path / "new" / "home"))
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert db.execute("SELECT version FROM schema_version").fetchall() == [(LATEST,)]
    db.close()


def test_foreign_keys_are_on(store: Store) -> None:
    assert store._db.execute("PRAGMA foreign_keys").fetchone()[0] == 1


def test_sessions_and_messages(store: Store) -> None:
    store.ensure_session("a", MODEL, "be brief")
    store.ensure_session("b", MODEL)
    store.set_messages("a", MESSAGES)
    assert store.load_messages("a") == MESSAGES
    assert store.load_messages("nobody") == []
    assert store.get_system("a") == "be brief"
    assert store.get_system("b") is None
    store.ensure_session("a", MODEL)  # no system given: the prompt is kept
    assert store.get_system("a") == "be brief"
    store.ensure_session("a", MODEL, "be long")
    assert store.get_system("a") == "be long"
    store.set_messages("a", MESSAGES[:1])  # /undo replaces the whole list
    assert store.load_messages("a") == MESSAGES[:1]
    assert set(store.session_names()) == {"a", "b"}
    rows = {r["name"]: r for r in store.sessions()}
    assert rows["a"]["messages"] == 1 and rows["a"]["turns"] == 0


def test_record_turn_stores_everything(store: Store) -> None:
    run = store.start_run(MODEL, 2, [10_000, 10_000])
    n1 = store.record_turn(
        run, "s", MESSAGES, turn_result(events=[add(0)], entries=[info(0)]), MODEL
    )
    more = MESSAGES + [{"role": "user", "content": "again"}, {"role": "assistant", "content": "x"}]
    second = turn_result(cached=40, events=[add(1), evict(0)], entries=[info(1, hits=1)])
    n2 = store.record_turn(run, "s", more, second, MODEL)
    assert (n1, n2) == (1, 2)
    assert store.load_messages("s") == more
    stats = store.stats()
    total = stats["total"]
    assert (total["turns"], total["hits"], total["misses"]) == (2, 1, 1)
    assert total["tokens_saved"] == 40 and total["evictions"] == 1
    assert total["entries"] == 1 and total["bytes"] == 150
    assert [r["bytes"] for r in stats["ranks"]] == [100, 50]
    assert [r["pressure"] for r in stats["ranks"]] == [0.5, 0.7]
    assert [e["id"] for e in store.entries()] == [1]
    log = store.evictions()
    assert len(log) == 1 and log[0]["entry"] == 0 and log[0]["turn"] == 2
    assert log[0]["bytes"] == [100, 50] and log[0]["pressures"] == [0.5, 0.95]
    assert [len(p["history"]) for p in store.pressure()] == [2, 2]
    rows = {r["name"]: r for r in store.sessions()}
    assert rows["s"]["turns"] == 2 and rows["s"]["cached_tokens"] == 40


def test_record_turn_is_all_or_nothing(store: Store) -> None:
    run = store.start_run(MODEL, 2, [None, None])
    store.record_turn(run, "s", MESSAGES, turn_result(events=[add(0)], entries=[info(0)]), MODEL)
    broken = turn_result(events=[add(1)], entries=[EntryInfo(1, None, "s", None, 1, [1, 1], 0, 0)])
    with pytest.raises(ExokvError):
        store.record_turn(run, "s", MESSAGES + MESSAGES, broken, MODEL)
    assert store.load_messages("s") == MESSAGES
    assert store.stats()["total"]["turns"] == 1
    assert [e["id"] for e in store.entries()] == [0]
    assert store._db.execute("SELECT COUNT(*) FROM cache_events").fetchone()[0] == 1
    assert store._db.execute("SELECT COUNT(*) FROM memory_samples").fetchone()[0] == 2


def test_clear_event_outside_a_turn_ends_every_entry(store: Store) -> None:
    run = store.start_run(MODEL, 2, [None, None])
    result = turn_result(events=[add(0), add(1)], entries=[info(0), info(1)])
    store.record_turn(run, "s", MESSAGES, result, MODEL)
    store.record_events(run, [CacheEvent("clear", 3, -1, 0, [0, 0], "s", "user")])
    assert store.entries() == []


def test_entry_ids_are_scoped_to_their_run(store: Store) -> None:
    first = store.start_run(MODEL, 2, [None, None])
    store.record_turn(first, "s", MESSAGES, turn_result(events=[add(0)], entries=[info(0)]), MODEL)
    store.end_run(first)
    second = store.start_run(MODEL, 2, [None, None])
    big = info(0, tokens=99)
    store.record_turn(second, "s", MESSAGES, turn_result(events=[add(0)], entries=[big]), MODEL)
    rows = store.entries()
    assert [(r["run"], r["id"], r["tokens"]) for r in rows] == [(second, 0, 99)]


def test_latest_run_is_shown_after_it_ended(store: Store) -> None:
    run = store.start_run(MODEL, 2, [None, None])
    store.record_turn(run, "s", MESSAGES, turn_result(events=[add(0)], entries=[info(0)]), MODEL)
    store.end_run(run)
    stats = store.stats()
    assert [r["id"] for r in stats["runs"]] == [run]
    assert stats["runs"][0]["running"] is False
    assert stats["total"]["entries"] == 1


def test_a_running_run_hides_older_ended_ones(store: Store) -> None:
    old = store.start_run(MODEL, 1, [None])
    store.end_run(old)
    live = store.start_run(MODEL, 1, [None])  # this test process: alive
    assert [r["id"] for r in store.stats()["runs"]] == [live]


def test_clear_keeps_conversations_and_running_runs(store: Store, tmp_path: Path) -> None:
    old = store.start_run(MODEL, 2, [None, None])
    store.record_turn(old, "s", MESSAGES, turn_result(events=[add(0)], entries=[info(0)]), MODEL)
    store.end_run(old)
    live = store.start_run(MODEL, 2, [None, None])
    store.record_turn(live, "t", MESSAGES, turn_result(events=[add(0)], entries=[info(0)]), MODEL)
    saved = caches_dir(tmp_path) / "s"
    saved.mkdir(parents=True)
    (saved / "cache.safetensors").write_bytes(b"x")
    counts = store.clear()
    assert counts["runs"] == 1 and counts["entries"] == 1 and counts["saved_caches"] == 1
    assert not caches_dir(tmp_path).exists()
    assert store.load_messages("s") == MESSAGES and store.load_messages("t") == MESSAGES
    assert [r["run"] for r in store.entries()] == [live]
    # The live run can still record.
    store.record_turn(live, "t", MESSAGES, turn_result(), MODEL)


V1_SQL = """
CREATE TABLE schema_version (version INTEGER NOT NULL);
INSERT INTO schema_version VALUES (1);
CREATE TABLE sessions (id INTEGER PRIMARY KEY, name TEXT NOT NULL UNIQUE,
    model TEXT NOT NULL DEFAULT '', system TEXT, created REAL NOT NULL, last_used REAL NOT NULL);
CREATE TABLE messages (session_id INTEGER NOT NULL REFERENCES sessions(id) ON DELETE CASCADE,
    position INTEGER NOT NULL, role TEXT NOT NULL, content TEXT NOT NULL,
    PRIMARY KEY (session_id, position));
CREATE TABLE turns (id INTEGER PRIMARY KEY, session_id INTEGER NOT NULL REFERENCES sessions(id),
    turn INTEGER NOT NULL, prompt_tokens INTEGER NOT NULL, cached_tokens INTEGER NOT NULL,
    prefilled_tokens INTEGER NOT NULL, generated_tokens INTEGER NOT NULL, ttft_s REAL NOT NULL,
    decode_tps REAL NOT NULL, created REAL NOT NULL);
CREATE TABLE cache_events (id INTEGER PRIMARY KEY, time REAL NOT NULL, kind TEXT NOT NULL,
    decision INTEGER NOT NULL, entry INTEGER NOT NULL, tokens INTEGER NOT NULL,
    bytes TEXT NOT NULL, session TEXT NOT NULL DEFAULT '', reason TEXT NOT NULL DEFAULT '');
CREATE TABLE memory_samples (id INTEGER PRIMARY KEY, time REAL NOT NULL, rank INTEGER NOT NULL,
    pressure REAL NOT NULL, cache_bytes INTEGER NOT NULL, budget INTEGER, rss INTEGER NOT NULL,
    mlx_active INTEGER NOT NULL);
INSERT INTO sessions VALUES (1, 'old', 'm', 'sys', 1000.0, 1000.0);
INSERT INTO messages VALUES (1, 0, 'user', 'hello'), (1, 1, 'assistant', 'hi');
INSERT INTO turns VALUES (1, 1, 1, 50, 20, 30, 4, 0.1, 40.0, 1000.0);
INSERT INTO cache_events VALUES (1, 1000.0, 'evict', 3, 7, 12, '[10,20]', 'old', 'budget');
INSERT INTO memory_samples VALUES (1, 1000.0, 1, 0.4, 5, 100, 1, 1);
"""


def make_v1(home: Path) -> Path:
    home.mkdir(parents=True, exist_ok=True)
    db = sqlite3.connect(db_path(home))
    db.executescript(V1_SQL)
    db.close()
    return db_path(home)


def test_a_v1_database_is_migrated_on_open(tmp_path: Path) -> None:
    make_v1(tmp_path)
    with Store.open(tmp_path) as s:
        assert s.load_messages("old") == [
            {"role": "user", "content": "hello"},
            {"role": "assistant", "content": "hi"},
        ]
        assert s.get_system("old") == "sys"
        log = s.evictions()
        assert [(e["entry"], e["bytes"], e["pressures"]) for e in log] == [(7, [10, 20], [])]
        stats = s.stats()
        assert stats["runs"][0]["model"] == "legacy" and stats["runs"][0]["ranks"] == 2
        assert stats["total"]["tokens_saved"] == 20
        run = s.start_run(MODEL, 1, [None])
        s.record_turn(run, "old", MESSAGES, turn_result(pressures=(0.1,)), MODEL)
    db = sqlite3.connect(db_path(tmp_path))
    assert db.execute("SELECT version FROM schema_version").fetchall() == [(LATEST,)]
    db.close()


def test_concurrent_openers_migrate_once(tmp_path: Path) -> None:
    make_v1(tmp_path)
    errors: list[BaseException] = []

    def opener() -> None:
        try:
            Store.open(tmp_path).close()
        except BaseException as err:  # noqa: BLE001 - reported by the assert below
            errors.append(err)

    threads = [threading.Thread(target=opener) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors
    with Store.open(tmp_path) as s:
        assert len(s.evictions()) == 1


def test_a_newer_schema_is_refused(tmp_path: Path) -> None:
    Store.open(tmp_path).close()
    db = sqlite3.connect(db_path(tmp_path))
    db.execute("UPDATE schema_version SET version = ?", (LATEST + 5,))
    db.commit()
    db.close()
    with pytest.raises(ExokvError, match="newer exokv"):
        Store.open(tmp_path)


def test_another_programs_sqlite_file_is_not_touched(tmp_path: Path) -> None:
    path = db_path(tmp_path)
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE sessions (x)")
    db.commit()
    db.close()
    before = path.read_bytes()
    with pytest.raises(ExokvError) as err:
        Store.open(tmp_path)
    assert str(path) in str(err.value)
    assert path.read_bytes() == before


def test_a_second_store_in_a_process_keeps_the_first_ones_locks(tmp_path: Path) -> None:
    """POSIX drops every lock a process holds on a file when it closes any descriptor
    of it. Opening a second Store must not do that to the first one's connection, or
    another process takes itself for the database's last user when it closes and
    deletes the WAL under the live writer (a CI run lost 37 of 50 turns that way)."""
    with Store.open(tmp_path) as writer:
        run = writer.start_run(MODEL, 2, [None, None])
        writer.record_turn(run, "s", MESSAGES, turn_result(), MODEL)
        wal = Path(str(db_path(tmp_path)) + "-wal")
        assert wal.exists()
        with Store.open(tmp_path):
            other = (
                f"import sqlite3; db = sqlite3.connect({str(db_path(tmp_path))!r}); "
                "db.execute('SELECT COUNT(*) FROM sqlite_master').fetchone(); db.close()"
            )
            subprocess.run([sys.executable, "-c", other], check=True, timeout=30)
            assert wal.exists(), "another process deleted the WAL of a live connection"
            writer.record_turn(run, "s", MESSAGES * 2, turn_result(), MODEL)
    with Store.open(tmp_path) as s:
        assert s.stats()["total"]["turns"] == 2


def _real_db_bytes(home: Path) -> bytes:
    with Store.open(home) as s:
        run = s.start_run(MODEL, 2, [None, None])
        for i in range(30):
            s.ensure_session(f"s{i}", MODEL, "x" * 500)
            s.record_turn(run, f"s{i}", MESSAGES * 20, turn_result(), MODEL)
    return db_path(home).read_bytes()


@pytest.mark.parametrize("damage", ["truncated", "first-page", "random", "random-with-magic"])
def test_a_damaged_file_is_reported_and_left_alone(tmp_path: Path, damage: str) -> None:
    good = _real_db_bytes(tmp_path / "good")
    assert len(good) > 16384
    content = {
        "truncated": good[: len(good) // 2],
        "first-page": good[:4096],
        "random": os.urandom(20000),
        "random-with-magic": b"SQLite format 3\x00" + os.urandom(20000),
    }[damage]
    path = db_path(tmp_path / "bad")
    path.parent.mkdir()
    path.write_bytes(content)
    with pytest.raises(ExokvError) as err:
        Store.open(tmp_path / "bad")
    message = str(err.value)
    assert "\n" not in message
    assert str(path) in message and "mv " in message and ".corrupt" in message
    assert path.read_bytes() == content
    assert not Path(str(path) + "-wal").exists()


def test_an_empty_file_becomes_a_new_database_and_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """0 bytes hold nothing to recover, but a store that lost its content is no new one:
    one warning, then a new database (said once: it is no longer empty)."""
    db_path(tmp_path).write_bytes(b"")
    with Store.open(tmp_path) as s:
        assert s.session_names() == []
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("exokv: warning: the state database "), err
    assert "was empty (0 bytes)" in err[0] and "they were lost" in err[0]
    with Store.open(tmp_path):
        pass
    assert capsys.readouterr().err == ""


def test_an_empty_read_only_home_says_read_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No database yet in a folder nobody can write (a read-only mount: even root gets
    EROFS, which os.access reports): say so and what to do, not SQLite's "unable to open"."""
    from exokv.state import connection

    home = tmp_path / "ro"
    home.mkdir()
    writable = os.access
    monkeypatch.setattr(
        connection.os, "access", lambda p, mode: mode != os.W_OK and writable(p, mode)
    )
    with pytest.raises(ExokvError) as err:
        Store.open(home)
    message = str(err.value)
    assert "\n" not in message and "read-only" in message and str(home) in message
    assert "set EXOKV_HOME to a writable directory" in message
    assert not db_path(home).exists()


def test_open_existing_creates_nothing(tmp_path: Path) -> None:
    assert Store.open_existing(tmp_path / "home") is None
    assert not (tmp_path / "home").exists()


def test_register_chat_and_running_chats(tmp_path: Path) -> None:
    assert running_chats(tmp_path) == []
    with register_chat(tmp_path, model=MODEL) as path:
        assert running_chats(tmp_path) == [os.getpid()]
        assert json.loads(path.read_text())["model"] == MODEL
    assert running_chats(tmp_path) == []
    assert not path.exists()


def test_stale_chat_files_are_ignored_and_removed(tmp_path: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(30)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    stale = run_dir / f"chat-{dead.pid}.json"
    stale.write_text(json.dumps({"pid": dead.pid, "started": 0}))
    # Our own pid, but "started" long before this process: a recycled pid.
    recycled = run_dir / f"chat-{os.getpid()}.json"
    recycled.write_text(json.dumps({"pid": os.getpid(), "started": 1.0}))
    assert running_chats(tmp_path) == []
    assert not stale.exists() and not recycled.exists()


# -- replies' exact tokens (schema v3) ------------------------------------------------------


def make_v2(home: Path) -> Path:
    """A database as the previous exokv left it: schema 2, one conversation."""
    from exokv.state.schema import MIGRATIONS

    home.mkdir(parents=True, exist_ok=True)
    db = sqlite3.connect(db_path(home), isolation_level=None)
    db.execute("BEGIN")
    db.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
    for migration in MIGRATIONS[:2]:
        migration(db)
    db.execute("INSERT INTO schema_version VALUES (2)")
    db.execute("INSERT INTO sessions VALUES (1, 'old', 'm', NULL, 1000.0, 1000.0)")
    db.execute(
        "INSERT INTO messages VALUES (1, 0, 'user', 'hello'), (1, 1, 'assistant', 'hi there')"
    )
    db.execute("COMMIT")
    db.close()
    return db_path(home)


def test_a_v2_database_gets_the_tokens_column(tmp_path: Path) -> None:
    assert LATEST >= 3  # later migrations keep the tokens column
    make_v2(tmp_path)
    with Store.open(tmp_path) as s:
        old = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi there"}]
        assert s.load_messages("old") == old
        assert s.load_messages("old", with_tokens=True) == old
        assert s.load_reply_tokens("old") == []
        # The migrated session takes tokens with its next turn.
        run = s.start_run(MODEL, 1, [None])
        more = [*old, {"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
        more[3] = {**more[3], "tokens": [7, 8]}
        s.record_turn(run, "old", more, turn_result(pressures=(0.1,)), MODEL)
        assert s.load_reply_tokens("old") == [("y", [7, 8])]
    db = sqlite3.connect(db_path(tmp_path))
    assert db.execute("SELECT version FROM schema_version").fetchall() == [(LATEST,)]
    columns = {r[1]: r for r in db.execute("PRAGMA table_info(messages)")}
    assert columns["tokens"][2] == "TEXT" and columns["tokens"][3] == 0  # nullable
    assert db.execute("SELECT tokens FROM messages WHERE position < 2").fetchall() == [
        (None,),
        (None,),
    ]
    db.close()


def test_reply_tokens_round_trip_with_the_turn(store: Store) -> None:
    run = store.start_run(MODEL, 2, [None, None])
    first = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "ok", "tokens": [5, 6]},
    ]
    store.record_turn(run, "s", first, turn_result(), MODEL)
    assert store.load_messages("s") == MESSAGES  # no tokens unless asked
    assert store.load_messages("s", with_tokens=True) == first
    assert store.load_reply_tokens("s") == [("ok", [5, 6])]
    second = [
        *first,
        {"role": "user", "content": "again"},
        {"role": "assistant", "content": "sure", "tokens": (9, 10, 11)},
        {"role": "user", "content": "more"},
        {"role": "assistant", "content": "untokened"},
    ]
    store.record_turn(run, "s", second, turn_result(), MODEL)
    assert store.load_reply_tokens("s") == [("ok", [5, 6]), ("sure", [9, 10, 11])]
    # What load_messages(with_tokens=True) gives, set_messages takes back as it is.
    store.set_messages("t", store.load_messages("s", with_tokens=True))
    assert store.load_reply_tokens("t") == store.load_reply_tokens("s")


def test_reply_tokens_are_all_or_nothing_with_the_turn(store: Store) -> None:
    run = store.start_run(MODEL, 2, [None, None])
    store.record_turn(run, "s", MESSAGES, turn_result(), MODEL)
    broken = turn_result(entries=[EntryInfo(1, None, "s", None, 1, [1, 1], 0, 0)])
    with_tokens = [MESSAGES[0], {**MESSAGES[1], "tokens": [1, 2]}]
    with pytest.raises(ExokvError):
        store.record_turn(run, "s", with_tokens, broken, MODEL)
    assert store.load_reply_tokens("s") == []
    with pytest.raises(ValueError):
        store.set_messages("s", [{"role": "user", "content": "hi", "tokens": [1]}])
    with pytest.raises(ValueError):
        store.set_messages("s", [{"role": "assistant", "content": "ok", "tokens": "12"}])
    assert store.load_messages("s") == MESSAGES


def test_set_messages_keeps_a_replys_tokens_unless_told(store: Store) -> None:
    # /undo and /system rewrite the list; a caller that passes no "tokens" loses none.
    convo = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "A", "tokens": [1]},
        {"role": "user", "content": "b"},
        {"role": "assistant", "content": "B", "tokens": [2, 3]},
    ]
    store.set_messages("s", convo)
    store.set_messages("s", store.load_messages("s")[:2])
    assert store.load_reply_tokens("s") == [("A", [1])]
    store.set_messages("s", [convo[0], {"role": "assistant", "content": "A", "tokens": None}])
    assert store.load_reply_tokens("s") == []
    store.set_messages("s", [convo[0], {"role": "assistant", "content": "A", "tokens": []}])
    assert store.load_reply_tokens("s") == []


class TokenClient(StubClient):
    """A client whose results carry the reply's token ids, as the engine's do; it keeps
    the requests it was sent (their replies carry the tokens, or nothing does)."""

    def __init__(self) -> None:
        self.requests: list[TurnRequest] = []
        self.count = 0

    def turn(self, request, on_text=None, on_progress=None) -> TurnResult:
        self.requests.append(request)
        self.count += 1
        return TurnResult(
            session=request.session, reply=f"reply {self.count}", prompt_tokens=10,
            cached_tokens=0, prefilled_tokens=10, generated_tokens=2, ttft_s=0.01,
            decode_tps=10.0, overhead_s=0.0, ranks=1, reply_tokens=[100 + self.count, self.count],
        )  # fmt: skip


def test_chat_keeps_reply_tokens_in_the_store_and_gives_them_back_on_resume(
    tmp_path: Path,
) -> None:
    from exokv.chat.conversation import ChatController, TurnSettings
    from exokv.frontend.hooks import StoreHooks

    with Store.open(tmp_path) as store:
        client = TokenClient()
        hooks = StoreHooks(store, store.start_run(MODEL, 1, [None]), MODEL, client)
        chat = ChatController(client, TurnSettings(), "c", hooks=hooks)
        for line in ["one", "two", "three", "/undo", "/system be brief", "/retry"]:
            chat.handle(line)
        expected = [("reply 1", [101, 1]), ("reply 4", [104, 4])]  # /undo, then /retry
        assert store.load_reply_tokens("c") == expected
    assert not (tmp_path / "replies").exists()

    with Store.open(tmp_path) as store:  # a new process resumes "c"
        client = TokenClient()
        hooks = StoreHooks(store, store.start_run(MODEL, 1, [None]), MODEL, client)
        chat = ChatController(client, TurnSettings(), "c", hooks=hooks)
        assert [m["content"] for m in chat.current.messages] == ["one", "reply 1", "two", "reply 4"]
        # Each reply's message holds its tokens, and the next request carries them.
        tokens = [m.get("tokens") for m in chat.current.messages]
        assert tokens == [None, [101, 1], None, [104, 4]]
        chat.handle("four")
        sent = client.requests[-1].messages
        assert [m.get("tokens") for m in sent if m["role"] == "assistant"] == [[101, 1], [104, 4]]
        assert chat.current.messages[-1] == {
            "role": "assistant",
            "content": "reply 1",
            "tokens": [101, 1],
        }
        chat.handle("/undo")
        assert store.load_reply_tokens("c") == expected
