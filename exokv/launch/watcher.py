"""A rank's watcher: its host's view of the rank process, said every second.

A rank's heartbeat is a thread of the rank's own Python, and a rank busy for a long
time (a long kernel, a starved machine, the GIL held) can leave that thread unrun
for seconds; from the front end a busy rank and a stopped one then look alike. The
watcher is a second, tiny process on the rank's host, started by the rank itself as
its first act (`exokv.rank.boot.beat`): every second it asks the OS (psutil) what
the rank is doing and prints one STATE_MARK line on the stderr it shares with the
rank, which the launcher relays to the front end like any rank line (over ssh for a
remote rank). The front end's Supervisor reads them: a late heartbeat with a
running rank is busy, a stopped or gone rank is dead, and no word from the watcher
either is a host gone (`exokv.launch.supervise`).

Why a child of the rank rather than a parent wrapped around it: the rank stays the
process mlx.launch started — its pid (the launcher's kill path), its environment,
stdin (rank 0's bootstrap line), exit code and signals are exactly as before —
and the watcher needs nothing from it after the start. The watcher ends when the
rank has gone; and when its own session ends (ssh hangs up: SIGHUP, or its lines
can no longer be written), or the front end on its host is gone, it ends the rank,
which a stopped or wedged rank would not do by itself (nor one whose GIL a call
holds: the ring's connect at start-up), so no rank outlives a chat.

The watcher's environment has no MLX_RANK: only the rank itself is a rank to
anything that looks for one.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any

import psutil

from exokv.launch.command import STATE_MARK, remove_scratch

WATCH_S = 1.0  # between two state lines
END_GRACE_S = 3.0  # a rank told to end (SIGTERM) gets this long before SIGKILL
RUNNING, STOPPED, GONE = "running", "stopped", "gone"


def state_of(process: Any) -> str:
    """`process` (a psutil.Process) as the front end judges it: running, stopped or gone.

    Anything but stopped (SIGSTOP, a debugger) or ended is running: sleeping on a
    collective, waiting on the disk and computing are all a rank at work.
    """
    try:
        status = process.status()
    except psutil.Error:
        return GONE
    if status in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
        return GONE
    if status in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP):
        return STOPPED
    return RUNNING


def state_line(rank: int, state: str, pid: int) -> str:
    """What the watcher prints (and the Supervisor parses: rank, state, the rank's pid)."""
    return f"{STATE_MARK}{rank} {state} {pid}\n"


def alive(pid: int) -> bool:
    """Whether process `pid` on this host still runs (a zombie has ended)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A killed front end is a zombie until its parent reaps it: gone all the same.
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def main(argv: list[str] | None = None) -> int:
    """`RANK PID [FRONT_END]`: watch process PID (this process's parent), rank RANK, until
    it is gone; end it if process FRONT_END (the front end on this host) is gone first."""
    args = sys.argv[1:] if argv is None else argv
    rank, pid = int(args[0]), int(args[1])
    front_end = int(args[2]) if len(args) > 2 else None
    ended: list[int] = []
    # The session's end (ssh hanging up, the launcher's kill): end the rank too.
    for sig in (signal.SIGHUP, signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: ended.append(signum))
    try:
        process = psutil.Process(pid)
    except psutil.Error:
        return 0
    while True:
        state = GONE if os.getppid() != pid else state_of(process)
        try:
            os.write(2, state_line(rank, state, pid).encode())  # one write: one whole line
        except OSError:
            ended.append(signal.SIGHUP)  # nobody reads: the session is gone
        if state == GONE:
            return 0
        if front_end is not None and not alive(front_end):
            # The rank's own beat ends it then, unless a call holds its GIL: the ring's
            # connect does, waiting for a peer that may never come.
            end(process)
            remove_scratch()
            return 0
        if ended:
            end(process)
            return 0
        time.sleep(WATCH_S)


def end(process: Any) -> None:
    """End the rank: SIGTERM (and SIGCONT, so a stopped one acts on it), then SIGKILL."""
    try:
        process.terminate()
        process.resume()
        process.wait(END_GRACE_S)
    except psutil.TimeoutExpired:
        try:
            process.kill()
        except psutil.Error:
            pass
    except psutil.Error:
        pass
