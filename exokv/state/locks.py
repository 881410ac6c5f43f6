"""One chat per session: an advisory lock file per open session under EXOKV_HOME/run/.

Two chats writing one conversation would interleave their turns into a history
neither of them saw, and every later prompt would be built from the wrong one.
So a session is open in one chat at a time, and a second chat that asks for it
gets a one-line error naming the chat that has it, rather than a read-only view:
a chat that cannot add turns is not what anyone started `exokv chat` for, and
the error tells them which process to finish first.

The lock is `flock` on a small file, so the kernel releases it when the holder
dies, even by SIGKILL: a crashed chat never leaves a session locked. The file
also says which pid holds it, for the error message.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from pathlib import Path

from exokv.config import exokv_home
from exokv.errors import ExokvError


class SessionBusy(ExokvError):
    """The session is open in another chat."""


class SessionLocks:
    """The sessions this chat holds; released on close (or when the process ends)."""

    def __init__(self, home: Path | None = None) -> None:
        self.directory = (home if home is not None else exokv_home()) / "run"
        self._held: dict[str, int] = {}  # session name -> open fd holding its lock

    def acquire(self, session: str) -> None:
        """Hold `session` for this chat, or raise SessionBusy naming the holder's pid."""
        if session in self._held:
            return
        fd = self._take(session)
        if fd is not None:
            self._held[session] = fd

    def check(self, session: str) -> None:
        """Raise SessionBusy now if another chat has `session`, before anything is said
        about resuming it; holds nothing (`acquire` takes it when the chat starts)."""
        if session not in self._held and (fd := self._take(session)) is not None:
            os.close(fd)

    def _take(self, session: str) -> int | None:
        """The lock's descriptor; None on a read-only home (nobody can write it anyway)."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            return hold(self._path(session), {"session": session})
        except LockHeld as held:
            who = f"another exokv chat (pid {held.pid})" if held.pid else "another exokv chat"
            raise SessionBusy(
                f"session {session!r} is open in {who}; end that chat first, "
                "or pick another --session"
            ) from None
        except OSError:
            return None

    def release_all(self) -> None:
        for fd in self._held.values():
            try:
                os.close(fd)  # closing the descriptor releases its flock
            except OSError:
                pass
        self._held.clear()

    def _path(self, session: str) -> Path:
        digest = hashlib.sha256(session.encode()).hexdigest()[:24]
        return self.directory / f"session-{digest}.lock"


class LockHeld(Exception):
    """Another process holds the lock; `pid` is its process id when it said so, `info`
    what else it wrote in the lock file."""

    def __init__(self, pid: int | None, info: dict | None = None) -> None:
        super().__init__(f"held by pid {pid}")
        self.pid = pid
        self.info = info or {}


def hold(path: Path, info: dict) -> int:
    """Take `path`'s flock for this process and write our pid in it; the open file
    descriptor holds the lock until it is closed (or the process ends). Raises LockHeld
    naming the holder, or OSError when the file cannot be opened."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        info = _info(fd)
        os.close(fd)
        raise LockHeld(_pid(info), info) from None
    os.ftruncate(fd, 0)
    os.write(fd, json.dumps({"pid": os.getpid(), **info}).encode())
    return fd


def _info(fd: int) -> dict:
    try:
        data = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _pid(info: dict) -> int | None:
    try:
        return int(info["pid"])
    except (KeyError, TypeError, ValueError):
        return None
