"""Plans have generations: a rank of an older plan of the same chat that still holds
its disk tier (its host went away and came back with it running) is stopped by the
new plan's rank on that host; another chat's lock, or a newer plan's, stays theirs."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from exokv.cache.disk import take_over
from exokv.state.locks import LockHeld

HOLDER = """
import sys, time
from pathlib import Path
from exokv.state.locks import hold
hold(Path(sys.argv[1]), {"what": "disk tier", "chat": sys.argv[2], "generation": int(sys.argv[3])})
print("held", flush=True)
time.sleep(600)
"""


def _holder(lock: Path, chat: str, generation: int) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(lock), chat, str(generation)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


@pytest.mark.timeout(60)
def test_an_older_plans_rank_is_stopped_and_the_lock_taken(tmp_path: Path) -> None:
    lock = tmp_path / "lock"
    old = _holder(lock, "chat-1", 1)
    try:
        fd = take_over(lock, ("chat-1", 2))
        assert old.wait(10) != 0  # stopped: killed, not ended by itself
        info = json.loads(lock.read_text())
        assert info["generation"] == 2 and info["chat"] == "chat-1"
        import os

        os.close(fd)
    finally:
        old.kill()


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("chat", "generation"), [("chat-2", 1), ("chat-1", 3), ("chat-1", 2)], ids=str
)
def test_a_lock_not_of_an_older_plan_of_this_chat_stays(
    tmp_path: Path, chat: str, generation: int
) -> None:
    lock = tmp_path / "lock"
    holder = _holder(lock, chat, generation)
    try:
        started = time.monotonic()
        with pytest.raises(LockHeld) as held:
            take_over(lock, ("chat-1", 2))
        assert time.monotonic() - started < 5  # refused at once, not waited on
        assert held.value.pid == holder.pid and psutil.pid_exists(holder.pid)
        assert holder.poll() is None
    finally:
        holder.kill()
        holder.wait(10)
