"""A rank's side of its start and its end, as the front end's Supervisor expects them.

What every rank program (the chat's `exokv.rank.main`, the bench's
`exokv.bench.rank_main`) does around its real work: learn its rank from the
launcher, beat on a standard stream so the front end knows it is alive (and end
when the front end is gone), read the bootstrap line on rank 0, release the
launcher's stdin, and turn a failure into the one marked line the front end
reads (`exokv.launch.supervise`).
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading
import time
import traceback
from typing import Any

from exokv.config import TEST_HOOKS, debug_enabled
from exokv.errors import ExokvError
from exokv.launch.command import BEAT_MARK, ERROR_MARK, rank_command, remove_scratch
from exokv.launch.watcher import alive
from exokv.wire import channel
from exokv.wire.messages import RankFailed

HEARTBEAT_S = 2.0
BOOTSTRAP_TIMEOUT = 60.0
_loaded = threading.Event()  # this rank's shard is loaded (see beat_loaded)
_watcher: subprocess.Popen[bytes] | None = None  # kept: reaped when it ends, never waited on


def launcher_rank() -> int:
    """This rank's number as the launcher set it, before the distributed group exists."""
    return int(os.environ.get("MLX_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))


def start_beating(rank: int, front_end: int | None = None, fd: int = 1) -> None:
    """Start this rank's watcher (exokv.launch.watcher), then its `beat` thread.

    The watcher is the host's word on whether the rank runs, for the times the beat
    thread is not run; it ends the rank when the front end is gone too, should that
    thread not run then. It is started here, before this returns: a thread started
    just before `mx.distributed.init` may not run until the ring has formed, since
    the ring's connect holds the GIL, and a watcher left to it would never start.
    """
    global _watcher
    _watcher = watch(rank, front_end)
    threading.Thread(target=beat, args=(rank, front_end, fd), daemon=True).start()


def beat(rank: int, front_end: int | None = None, fd: int = 1) -> None:
    """Say "alive" on `fd` every few seconds, which the launcher relays to the front end.

    Every rank does this, not just rank 0: a rank that hangs (a stopped process, a
    Mac gone to sleep) leaves the others blocked in a collective, still alive and
    beating on the channel; only its own silence names it. The beat comes from a
    thread, and MLX releases the GIL while it computes, so a long prefill beats on.

    And the other way round: when the front end (`front_end`, a pid on this host)
    is gone — killed, or timed out by a script — the rank ends, so the launcher
    ends too. The launcher runs in its own process group, which a signal to the
    front end's group does not reach, so nothing else would stop it.
    """
    line = f"{BEAT_MARK}{rank}\n".encode()
    hold = TEST_HOOKS.hold_beat(rank)
    while True:
        if hold and _loaded.is_set():
            _hold_beat(rank, hold)
            hold = 0.0
        if front_end is not None and not alive(front_end):
            remove_scratch()
            os._exit(1)
        try:
            os.write(fd, line)  # one small write: never split from, or into, other lines
        except OSError:
            os._exit(1)  # nobody reads us any more
        time.sleep(HEARTBEAT_S)


def beat_loaded(rank: int, fd: int = 1) -> None:
    """A beat that also says this rank's shard is loaded: the front end shows start-up progress."""
    _loaded.set()
    os.write(fd, f"{BEAT_MARK}{rank} loaded\n".encode())


def watch(rank: int, front_end: int | None = None) -> subprocess.Popen[bytes]:
    """Start the watcher of this process (rank `rank`) on this host: it shares our stderr,
    not our stdin (rank 0's bootstrap line is ours), and has no MLX_RANK of its own.
    `front_end`: the front end's pid on this host, whose end ends the rank."""
    env = {k: v for k, v in os.environ.items() if k not in ("MLX_RANK", "OMPI_COMM_WORLD_RANK")}
    pids = [str(os.getpid())] + ([str(front_end)] if front_end is not None else [])
    return subprocess.Popen(
        [*rank_command(module="exokv.launch.watcher"), str(rank), *pids],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        env=env,
    )


def _hold_beat(rank: int, seconds: float) -> None:
    """EXOKV_TEST_HOLD_BEAT: this thread unrun for `seconds` while the rank works on."""
    print(
        f"exokv-test: rank {rank} holds its heartbeat for {seconds:g} s",
        file=sys.stderr,
        flush=True,
    )
    time.sleep(seconds)
    print(f"exokv-test: rank {rank} beats again", file=sys.stderr, flush=True)


def release_stdin() -> None:
    """Close our end of the launcher's stdin pipe (nothing more is read from it).

    mlx.launch select()s each rank's stdin for writing, which is always ready, so
    its I/O threads spin (a core between them, on a small machine). Once the read
    end is closed, its next write fails with EPIPE and it stops watching that pipe;
    the front end sends a byte now and then until the ranks are ready to trigger
    exactly that (exokv.launch.supervise.Supervisor.nudge). So every rank program
    calls this first, before the ring forms and before the model loads.
    """
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)


def report_error(rank: int, err: BaseException, link: channel.Connection | None) -> None:
    message = describe(err)
    if debug_enabled():
        traceback.print_exc()
    sys.stderr.flush()  # a traceback above (debug) first
    # One write, the newline with it: print() writes the line and its newline apart, and
    # mlx.launch relays each rank's output in the pieces it reads, so another rank's (or
    # watcher's) line could land between them and glue onto this one, which the front
    # end then cannot read: the cause was lost (a rank named only by its exit code).
    line = ERROR_MARK + json.dumps({"rank": rank, "message": message}) + "\n"
    os.write(sys.stderr.fileno(), line.encode())
    if link is not None:
        try:
            link.send(RankFailed(rank, message))
        except ExokvError:
            pass


def describe(err: BaseException) -> str:
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    if "Couldn't bind socket" in text and "98" in text:
        return "port in use: pass another --starting-port"
    if isinstance(err, ExokvError):
        return text
    return f"{type(err).__name__}: {text}"


def read_bootstrap(timeout: float = BOOTSTRAP_TIMEOUT) -> dict[str, Any]:
    """The one line the front end wrote to the launcher's stdin: addresses and token."""
    fd = sys.stdin.fileno()
    data = b""
    deadline = time.monotonic() + timeout
    while b"\n" not in data:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise ExokvError("rank 0 got no channel address from the front end")
        chunk = os.read(fd, 4096)
        if not chunk:
            raise ExokvError("rank 0's standard input closed before the channel address came")
        data += chunk
    line = data.split(b"\n", 1)[0].strip()
    boot = json.loads(line)
    if not isinstance(boot, dict) or "token" not in boot or "addresses" not in boot:
        raise ExokvError("rank 0 got a malformed bootstrap line")
    return boot
