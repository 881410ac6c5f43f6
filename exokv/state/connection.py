"""Opening the one SQLite database under EXOKV_HOME and checking it is exokv's, whole.

A damaged or foreign file is reported with the commands that move it aside, never
"repaired"; a read-only one is opened read-only; one opener at a time migrates.

Durability: WAL with `synchronous = FULL`, so a commit is on disk before it returns
(under NORMAL the last commits can roll back after a power cut), and on macOS
`fullfsync`, because a plain fsync there leaves the data in the drive's cache.
`SYNCHRONOUS` is a module constant so benchmarks/bookkeeping.py can compare NORMAL.
"""

from __future__ import annotations

import os
import shlex
import sqlite3
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import quote

from exokv.config import exokv_home
from exokv.errors import ExokvError
from exokv.state.schema import LATEST, current_version, foreign_tables, migrate

DB_NAME = "exokv.db"
BUSY_TIMEOUT_S = 10.0
SYNCHRONOUS = "FULL"  # see the module's docstring


def db_path(home: Path | None = None) -> Path:
    return (home if home is not None else exokv_home()) / DB_NAME


@contextmanager
def _opening(path: Path) -> Iterator[None]:
    """One opener at a time sets a database up (integrity check, WAL, migrations).

    SQLite answers "database is locked" at once, not after the busy timeout, to a
    connection that switches a rollback-journal file to WAL while another has it
    open, so concurrent first opens of an old database are taken in turn: an
    `flock` on a file beside it, which the system releases if the holder dies.
    """
    import fcntl  # deferred: POSIX only

    try:
        fd = os.open(path.with_name(path.name + "-open.lock"), os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        yield  # nowhere to put the lock (a read-only folder): nothing can write either
        return
    try:
        deadline = time.monotonic() + BUSY_TIMEOUT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise ExokvError(
                        f"the state database {path} is being opened by another exokv "
                        "that does not finish; try again"
                    ) from None
                time.sleep(0.02)
        yield
    finally:
        os.close(fd)


def _corrupt(path: Path, why: str) -> ExokvError:
    why = " ".join(why.split())  # one line, whatever SQLite said
    moves = [f"mv {shlex.quote(str(path))} {shlex.quote(str(path) + '.corrupt')}"]
    for suffix in ("-wal", "-shm"):
        # A stale WAL next to a fresh database would be replayed into it.
        side = Path(str(path) + suffix)
        if side.exists():
            moves.append(
                f"mv {shlex.quote(str(side))} {shlex.quote(str(path) + '.corrupt' + suffix)}"
            )
    return ExokvError(
        f"the state database {path} cannot be used ({why}); nothing was changed: "
        f"move it aside with `{' && '.join(moves)}` and exokv will start a new one"
    )


def _writable(path: Path) -> bool:
    """Whether this process may write the database and make its -wal/-shm files."""
    return os.access(path, os.W_OK) and os.access(path.parent, os.W_OK)


def read_only_error(path: Path) -> ExokvError:
    return ExokvError(
        f"the state database {path} is read-only (nothing wrong with it: its folder or "
        "file cannot be written); reading commands such as `exokv cache stats` work, a "
        "chat needs EXOKV_HOME set to a writable directory"
    )


def new_home_error(path: Path) -> ExokvError:
    """A home with no database yet, in a folder nobody can write (a read-only mount)."""
    return ExokvError(
        f"the state database {path} cannot be created: {path.parent} is read-only (nothing "
        "is stored there yet, so there is nothing to read either); set EXOKV_HOME to a "
        "writable directory"
    )


def _warn_if_emptied(path: Path) -> None:
    """A 0-byte database is started as a new one, but said: exokv never leaves one
    empty past its first open, so the file lost what it held (a truncated copy, a full
    disk), or a first open was cut short. Refusing would not help: 0 bytes hold
    nothing to recover, so moving the file aside would end the same way."""
    if path.stat().st_size == 0:
        print(
            f"exokv: warning: the state database {path} was empty (0 bytes); a new one "
            "was started in its place: if it held sessions, they were lost before this run",
            file=sys.stderr,
            flush=True,
        )


def _check_readable(path: Path) -> None:
    """The file's header is left to SQLite ("file is not a database", which
    _check_integrity reports as damage): opening the file here would be unsafe. POSIX
    drops all of a process's locks on a file when any descriptor of it is closed, so
    reading it while this process has a connection to it (a second Store in another
    thread) would let another process take it for the last user and delete the WAL
    under the live writer, losing its turns."""
    if not os.access(path, os.R_OK):
        raise ExokvError(f"cannot read the state database {path}: permission denied")


class _Damaged(Exception):
    """Raised inside ``connect``; reported only after the connection is closed, so the
    advice names exactly the side files (-wal, -shm) that are left on disk."""


@contextmanager
def _closed_on_failure(db: sqlite3.Connection, path: Path) -> Iterator[None]:
    """Opening: a damaged file is reported as such; any failure closes the connection."""
    try:
        yield
    except _Damaged as err:
        db.close()
        raise _corrupt(path, str(err)) from None
    except BaseException:
        db.close()
        raise


def connect(path: Path, read_only_ok: bool = False) -> sqlite3.Connection:
    """The database at `path`, checked, in WAL and migrated (created when absent).

    Read-only when it cannot be written and `read_only_ok` (the reading commands);
    otherwise such a database is refused with one line.
    """
    existed = path.exists()
    if existed:
        _check_readable(path)
        if not _writable(path):
            if not read_only_ok:
                raise read_only_error(path)
            return _connect_read_only(path)
        _warn_if_emptied(path)
    elif path.parent.is_dir() and not os.access(path.parent, os.W_OK):
        raise new_home_error(path)
    try:
        db = sqlite3.connect(
            str(path),
            timeout=BUSY_TIMEOUT_S,
            isolation_level=None,
            check_same_thread=False,
        )
    except sqlite3.Error as err:
        raise ExokvError(f"cannot open the state database {path}: {err}") from err
    with _closed_on_failure(db, path), _opening(path):
        if existed:
            _check_integrity(db, path)
        with guarded(path):
            if existed and (tables := foreign_tables(db)):
                raise _Damaged(f"an SQLite database, but not exokv's: tables {', '.join(tables)}")
            db.row_factory = sqlite3.Row
            db.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
            db.execute("PRAGMA foreign_keys = ON")
            if db.execute("PRAGMA journal_mode").fetchone()[0].lower() != "wal":
                db.execute("PRAGMA journal_mode = WAL")
            db.execute(f"PRAGMA synchronous = {SYNCHRONOUS}")
            if sys.platform == "darwin":
                db.execute("PRAGMA fullfsync = ON")
                db.execute("PRAGMA checkpoint_fullfsync = ON")
            migrate(db, str(path))
    return db


def _connect_read_only(path: Path) -> sqlite3.Connection:
    # A WAL database needs its -shm file, which cannot be made in a read-only folder;
    # immutable=1 reads the file as it is, which is right when nobody can write it.
    uri = f"file:{quote(str(path))}?immutable=1"
    try:
        db = sqlite3.connect(uri, uri=True, isolation_level=None, check_same_thread=False)
    except sqlite3.Error as err:
        raise ExokvError(f"cannot open the state database {path}: {err}") from err
    with _closed_on_failure(db, path):
        _check_integrity(db, path)
        with guarded(path):
            db.row_factory = sqlite3.Row
            found = current_version(db)
        if found != LATEST:
            raise ExokvError(
                f"the state database {path} is read-only and at schema {found}, not "
                f"{LATEST}; open it once where it can be written to upgrade it"
            )
    return db


def _check_integrity(db: sqlite3.Connection, path: Path) -> None:
    # Before any write, so a damaged file is reported, never "repaired".
    try:
        verdict = db.execute("PRAGMA quick_check(1)").fetchone()[0]
    except sqlite3.DatabaseError as err:
        if "locked" in str(err) or "busy" in str(err):
            raise database_error(path, err) from err
        raise _Damaged(str(err)) from err
    if verdict != "ok":
        # SQLite's verdict spans lines ("*** in database main ***\nOn tree page 5 ...").
        lines = [x for x in str(verdict).splitlines() if x.strip() and "***" not in x]
        raise _Damaged("; ".join(lines) or "damaged")


def database_error(path: Path, err: sqlite3.Error) -> ExokvError:
    """What an SQLite error on the database at `path` tells the user, in one line."""
    text = str(err)
    lowered = text.lower()
    if "locked" in lowered or "busy" in lowered:
        return ExokvError(
            f"the state database {path} stayed locked by another exokv process for "
            f"more than {BUSY_TIMEOUT_S:.0f} s; try again"
        )
    if "readonly" in lowered or "read-only" in lowered:
        return read_only_error(path)
    if "malformed" in lowered or "not a database" in lowered or "corrupt" in lowered:
        return _corrupt(path, text)
    return ExokvError(f"state database {path}: {text}")


@contextmanager
def guarded(path: Path) -> Iterator[None]:
    """SQLite's errors on the database at `path` raised as ExokvError (database_error)."""
    try:
        yield
    except sqlite3.Error as err:
        raise database_error(path, err) from err
