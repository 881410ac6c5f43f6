"""Which chats are running now: one small file per chat process under EXOKV_HOME/run/.

A file, not a database row, because a chat that is killed cannot clean up after
itself: the pid in the name plus its start time tell a live chat from a stale
file, and stale files are removed by whoever notices them.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil

from exokv.config import exokv_home


def _run_dir(home: Path | None) -> Path:
    return (home if home is not None else exokv_home()) / "run"


def process_started(pid: int) -> float | None:
    """The pid's start time (epoch seconds), or None when no such live process."""
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return None
        return proc.create_time()
    except (psutil.NoSuchProcess, psutil.AccessDenied, ProcessLookupError):
        return None


def pid_alive(pid: int, started: float | None = None) -> bool:
    """True when ``pid`` runs and, if ``started`` is given, is not a newer process reusing it."""
    created = process_started(pid)
    if created is None:
        return False
    # A recycled pid belongs to a process created after the one we recorded.
    return started is None or created <= started + 1.0


@contextmanager
def register_chat(home: Path | None = None, **info: Any) -> Iterator[Path]:
    """Mark this process as a running chat for as long as the block runs."""
    directory = _run_dir(home)
    directory.mkdir(parents=True, exist_ok=True)
    pid = os.getpid()
    path = directory / f"chat-{pid}.json"
    data = {"pid": pid, "started": process_started(pid) or time.time(), **info}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)  # readers never see a half-written file
    try:
        yield path
    finally:
        path.unlink(missing_ok=True)


def running_chats(home: Path | None = None) -> list[int]:
    """Pids of the chats running now; files left by dead chats are removed."""
    directory = _run_dir(home)
    if not directory.is_dir():
        return []
    pids = []
    for path in sorted(directory.glob("chat-*.json")):
        try:
            pid = int(path.stem.removeprefix("chat-"))
        except ValueError:
            continue
        try:
            started = json.loads(path.read_text()).get("started")
        except (OSError, ValueError, AttributeError):
            started = None
        if pid_alive(pid, started):
            pids.append(pid)
        else:
            try:
                path.unlink(missing_ok=True)
            except OSError:
                pass  # a read-only home must not stop a read-only command
    return pids
