"""Supervisor: the launcher and the ranks it started, watched from the front end.

One per launch. It starts mlx.launch (`exokv.launch.command` planned it: ranks on this
machine, or over ssh through a hostfile) in its own process group, so Ctrl-C in the
terminal reaches only the front end and one kill ends every rank; drains the
launcher's stdout and stderr in threads, taking the ranks' heartbeats out (every
rank beats every few seconds, even while the model computes: `exokv.rank.boot.beat`)
and their watchers' state lines (each rank's host says every second whether the
rank process runs: `exokv.launch.watcher`), keeping the rest as a tail; judges whether
every rank is alive; names the cause when the ranks fail; and ends the process group.

The rule, the same for every rank, on this machine or another: a heartbeat within
`heartbeat_timeout` is alive. A later one is judged by what the rank's host last
said, if it said it within that same bound: running is busy (a long step, a beat
thread left unrun), until the silence passes the wedged limit (`wedged_after`,
`exokv.config.WEDGED_S`), when the rank is reported wedged; stopped or gone is
dead; and no word from the host either (a host asleep, ssh gone) is dead too.

The chat's ClusterClient and `exokv bench --ranks` both run their ranks through it;
what differs between them (the timeouts, what counts as the result) they pass in or
keep. A `Cause` names the rank and what happened to it; what that means (the chat
ends, the ranks start again, the bench stops) each caller says in its own words.
"""

from __future__ import annotations

import collections
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, Any

import psutil

from exokv.config import TEST_HOOKS, debug_enabled
from exokv.launch.command import BEAT_MARK, ERROR_MARK, STATE_MARK, LaunchPlan
from exokv.launch.watcher import GONE, RUNNING, STOPPED, state_of

SETTLE_S = 4.0  # after a failure, how long the launcher gets to report which rank died
# Checks come a fraction of a second apart; this much between two means this process was
# not run (a loaded or paused machine): the beats sent meanwhile may not be read yet.
_SELF_STALL_S = 2.0
_NUDGE_S = 0.2  # start-up nudges' period (see _nudge_until_ready)
_NUDGE_FOR_S = 180.0  # and their end: every rank lets stdin go as it starts, before the ring
_TAIL_LINES = 200
_NODE_EXIT = re.compile(r"Node with rank (\d+) (?:exited with code (-?\d+)|was killed)")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_BEAT = re.compile(re.escape(BEAT_MARK) + r"(\d+)")
_STATE = re.compile(re.escape(STATE_MARK) + r"(\d+) (\w+) (\d+)")
# How a rank reports that another rank went away (a consequence, not the cause).
# "lost rank N": exokv.wire.wake, a rank waiting on the doorbell (between turns, before
# each stop check, for each prefill piece on two pipeline ranks) when the other went away.
_PEER_LOST = re.compile(
    r"peer was lost|closed by the peer|send/recv errors|errno 104|lost rank \d+", re.I
)
_TERMINATED_BY_SIGNAL = "was terminated (SIGTERM)"
_JSON = json.JSONDecoder()


@dataclass(frozen=True)
class Cause:
    """Why the ranks are gone, in one line that names the rank where it can.

    `ended`: the line says only how a rank ended (killed by a signal, an exit code),
    which reads as unfinished alone: the caller follows it with its consequence. A
    rank's own error or a silent rank already reads as a whole sentence.
    """

    text: str
    ended: bool = False

    def worded(self, consequence: str) -> str:
        """The line a user sees: `consequence` (say, "the chat cannot go on") where needed."""
        return f"{self.text}; {consequence}" if self.ended else self.text


class Supervisor:
    """The launcher of `plan`, its output and its ranks' liveness.

    `heartbeat_timeout`: the longest silence of a rank's beats (and of its host's
    word on it) before it counts as lost; `wedged_after`: the longest silence of a
    rank whose host says it runs (the module docstring has the rule). `start_timeout`:
    if given, every rank must have beaten once within this long of the start (else
    judged from `expect_beats`). `on_beat(rank, loaded)` is called for each beat;
    `on_line(stream, line)` for every other line, and a line it returns True for is
    the caller's (not kept in the tail, not echoed).
    """

    def __init__(
        self,
        plan: LaunchPlan,
        heartbeat_timeout: float,
        start_timeout: float | None = None,
        on_beat: Callable[[int, bool], None] | None = None,
        on_line: Callable[[str, str], bool] | None = None,
        wedged_after: float | None = None,
    ) -> None:
        self.plan = plan
        self.heartbeat_timeout = heartbeat_timeout
        self.wedged_after = TEST_HOOKS.wedged_s() if wedged_after is None else wedged_after
        self.start_timeout = start_timeout
        self._on_beat = on_beat
        self._on_line = on_line
        self.proc: subprocess.Popen[bytes] | None = None
        self.tails: dict[str, collections.deque[str]] = {
            "stdout": collections.deque(maxlen=_TAIL_LINES),
            "stderr": collections.deque(maxlen=_TAIL_LINES),
        }
        self.beats: dict[int, float] = {}  # rank -> when its last beat came
        self._drains: list[threading.Thread] = []
        self._secret = ""
        self._started = time.monotonic()
        self._checked = self._started  # the last liveness check (see `silent`)
        # rank -> (what its host's watcher last said, when, the rank's pid there)
        self.states: dict[int, tuple[str, float, int]] = {}
        self._processes: dict[int, Any] = {}  # a rank on this machine -> its psutil.Process
        self._ready = threading.Event()  # set: the ranks are ready, the start-up nudges over

    def start(
        self, env: dict[str, str] | None = None, first_line: str | None = None, secret: str = ""
    ) -> None:
        """Start the launcher and its drains; `first_line` goes to its stdin, which it
        forwards to every rank (rank 0 reads it: `exokv.rank.boot.read_bootstrap`).
        `secret` (the channel's token) is masked in the tails: a pty may echo that line."""
        self._secret = secret
        self._started = self._checked = time.monotonic()
        self.proc = subprocess.Popen(
            self.plan.argv,
            env=env,
            stdin=subprocess.PIPE,  # kept open: at end of file mlx.launch spins on it
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # own process group: no stray Ctrl-C, one kill ends all
        )
        for name, stream in (("stdout", self.proc.stdout), ("stderr", self.proc.stderr)):
            assert stream is not None
            t = threading.Thread(target=self._drain, args=(name, stream), daemon=True)
            t.start()
            self._drains.append(t)
        if first_line is not None:
            assert self.proc.stdin is not None
            self.proc.stdin.write((first_line + "\n").encode())
            self.proc.stdin.flush()
        self._ready = threading.Event()  # this launch's own: a restart's thread is another
        threading.Thread(target=self._nudge_until_ready, args=(self._ready,), daemon=True).start()

    def poll(self) -> int | None:
        """The launcher's exit code once it has exited."""
        return self.proc.poll() if self.proc is not None else None

    def ranks_ready(self) -> None:
        """Every rank is past release_stdin (rank 0 said it is ready): one last nudge,
        and the start-up nudges stop."""
        self._ready.set()
        self.nudge()

    def _nudge_until_ready(self, ready: threading.Event) -> None:
        """Nudge from the start until `ranks_ready`, the launcher's end, or _NUDGE_FOR_S.

        The ranks release their stdin within a second of starting, long before they
        are ready; each second of spinning launcher threads until then is a core taken
        from the ranks' imports and loading. A nudge before a rank released is data in
        its pipe that nobody reads (rank 0 reads only the first line: the bootstrap).
        The bench and the link test have no ready moment: the limit ends their nudges,
        long after every rank let go, rather than at the end of an hours-long run (an
        ssh rank's relay may not drain them).
        """
        until = time.monotonic() + _NUDGE_FOR_S
        while not ready.wait(_NUDGE_S) and time.monotonic() < until:
            if self.proc is None or self.proc.poll() is not None:
                return
            self.nudge()

    def nudge(self) -> None:
        """One byte for every rank's stdin through the launcher: each rank has closed it.

        mlx.launch's per-rank I/O threads spin on an always-writable stdin until a write
        fails; this write makes it fail, so they stop (see exokv.rank.boot.release_stdin).
        """
        if self.proc is None or self.proc.stdin is None:
            return
        try:
            self.proc.stdin.write(b"\n")
            self.proc.stdin.flush()
        except (OSError, ValueError):  # ValueError: `stop` closed it meanwhile
            pass

    def expect_beats(self) -> None:
        """From now on every rank must beat, one that never did too (the chat's ranks
        start beating before rank 0 can connect: a rank that hangs loading is named)."""
        self._checked = now = time.monotonic()
        self.beats = {r: now for r in range(self.plan.ranks)}

    # -- liveness ------------------------------------------------------------------------

    def silent(self, channel_seen: float | None = None) -> str | None:
        """The rank that is dead or wedged, if one is, as a cause; None while every rank
        beats or is busy (the rule: the module docstring).

        `channel_seen`: when rank 0 last spoke over the front end's channel (the chat's
        rank 0 beats there too); its silence is judged the same way.
        """
        now = time.monotonic()
        checked, self._checked = self._checked, now
        if now - checked > _SELF_STALL_S:
            return None  # judged at the next check, once the readers have run
        if self.start_timeout is not None and now - self._started > self.start_timeout:
            missing = [r for r in range(self.plan.ranks) if r not in self.beats]
            if missing:
                return (
                    f"rank {missing[0]} did not start within {self.start_timeout:.0f} s "
                    "(the launcher or the distributed setup hangs)"
                )
        signs = sorted(self.beats.items())
        if channel_seen is not None:
            signs.append((0, channel_seen))  # rank 0's beats over the channel
        for rank, last in signs:
            cause = self._judge(rank, now - last, now)
            if cause is not None:
                return cause
        return None

    def _judge(self, rank: int, quiet: float, now: float) -> str | None:
        """The cause for a rank silent for `quiet` seconds, or None: alive or busy."""
        timeout = self.heartbeat_timeout
        if quiet <= timeout:
            return None
        state = self.host_state(rank, now)
        host = self._host(rank)
        if state == RUNNING:
            if quiet <= self.wedged_after:
                return None  # busy: a long step, or its beat thread left unrun
            return (
                f"rank {rank} on {host!r} is wedged: its process runs but has said nothing "
                f"for over {self.wedged_after:.0f} s"
            )
        why = {
            STOPPED: f"its process on {host!r} is stopped",
            GONE: f"its process on {host!r} has gone",
        }.get(state or "", f"and no word from its host {host!r}: asleep or unreachable")
        return f"rank {rank} stopped responding (no heartbeat for {timeout:.0f} s; {why})"

    def host_state(self, rank: int, now: float | None = None) -> str | None:
        """What `rank`'s host says of its process (running, stopped, gone); None when
        its watcher said nothing within the heartbeat timeout.

        A rank on this machine is asked of the OS directly (the pid its watcher
        named), with the watcher's own test: that answer never waits on the launcher
        relaying a line (a loaded machine leaves every process unrun for seconds:
        benchmarks/stalls.py measured up to 6.6 s at load 10 to 20).
        """
        said = self.states.get(rank)
        if said is None:
            return None
        state, when, pid = said
        if self.plan.local and state != GONE:
            try:
                process = self._processes.get(rank)
                if process is None or process.pid != pid:
                    process = self._processes[rank] = psutil.Process(pid)
            except psutil.Error:
                return GONE
            return state_of(process)
        now = time.monotonic() if now is None else now
        return state if now - when <= self.heartbeat_timeout else None

    def _host(self, rank: int) -> str:
        hosts = self.plan.hosts
        return hosts[rank].ssh if rank < len(hosts) else f"rank {rank}'s host"

    # -- the cause, and the end ----------------------------------------------------------

    def diagnose(self, cause: str, settle: bool = True) -> Cause:
        """The cause of a failure first seen as `cause`.

        `settle`: give the launcher a moment to notice the dead rank and say which it
        was; pointless when a rank hangs (nothing will exit by itself).
        """
        if not settle:
            return Cause(cause)
        if self._exited_within(SETTLE_S):
            self.drained(1.0)  # the launcher's last words reach the tails
        hosts = [h.ssh for h in self.plan.hosts]
        # A remote rank runs under `ssh -tt`, whose pseudo-terminal merges its stderr
        # into the launcher's stdout: its one-line error arrives there.
        relayed = [x for x in self.tails["stdout"] if ERROR_MARK in x]
        return diagnose([*relayed, *self.tails["stderr"]], cause, hosts)

    def drained(self, timeout: float) -> None:
        """Wait up to `timeout` seconds per stream for the launcher's last lines."""
        for t in self._drains:
            t.join(timeout=timeout)

    def end(self, patience: float = 0.0) -> None:
        """End the launcher and every local rank it started (its process group).

        `patience` seconds for them to leave on their own first (after a shutdown
        message); then SIGTERM, then SIGKILL, the launcher's stdin closed, and its
        last lines drained.
        """
        proc = self.proc
        if proc is None:
            return
        self._exited_within(patience)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                break
            if self._exited_within(3.0) and sig == signal.SIGTERM:
                time.sleep(0.2)  # the launcher is gone; its ranks may still be exiting
        self._exited_within(1.0)
        if proc.stdin is not None:
            try:
                proc.stdin.close()
            except OSError:
                pass
        self.drained(1.0)

    def _exited_within(self, timeout: float) -> bool:
        if self.proc is None:
            return False
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return False
        return True

    def _drain(self, name: str, stream: IO[bytes]) -> None:
        tail = self.tails[name]
        debug = debug_enabled()
        for raw in iter(stream.readline, b""):
            line = _ANSI.sub("", raw.decode(errors="replace")).rstrip()
            if self._on_line is not None and self._on_line(name, line):
                continue
            # A line glued to a rank's error (see `_rank_errors`) is kept for `diagnose`.
            kept = ERROR_MARK in line
            said = _STATE.search(line)
            if said:
                rank, state, pid = int(said.group(1)), said.group(2), int(said.group(3))
                self.states[rank] = (state, time.monotonic(), pid)
                if not kept:
                    continue
            beat = _BEAT.search(line)
            if beat:
                rank = int(beat.group(1))
                self.beats[rank] = time.monotonic()
                if self._on_beat is not None:
                    self._on_beat(rank, line.endswith(" loaded"))
                if not kept:
                    continue
            if self._secret:
                line = line.replace(self._secret, "***")
            tail.append(line)
            if debug:
                print(f"[ranks {name}] {line}", file=sys.stderr)
        stream.close()


def diagnose(stderr_lines: list[str], cause: str, hosts: list[str] | None = None) -> Cause:
    """The rank that failed first and why, from the launcher's output (else `cause`).

    When one rank dies, the others fail in turn (a collective loses its peer) and
    the launcher terminates whatever is left, so the first cause is picked in this
    order: a rank killed by a signal, a rank's own error, a rank that exited with
    an error code, and only then a rank that merely lost its peers.
    """
    errors: dict[int, str] = {}
    exits: list[tuple[int, str]] = []
    for line in stderr_lines:
        for rank, message in _rank_errors(line):
            errors.setdefault(rank, message)
        match = _NODE_EXIT.search(line)
        if match:
            exits.append((int(match.group(1)), _exit_cause(match.group(2))))
    for rank, why in exits:
        if why.startswith("was killed"):
            return Cause(f"rank {rank} {why}", ended=True)
    own = {r: m for r, m in errors.items() if not _PEER_LOST.search(m)}
    if exits and exits[0][1] == _TERMINATED_BY_SIGNAL and not own:
        # SIGTERM is also how the launcher ends the other ranks, but only after the
        # first one went: the first to go is the one someone (or something) terminated.
        return Cause(f"rank {exits[0][0]} {exits[0][1]}", ended=True)
    for rank, _ in exits:
        if rank in own:
            return Cause(f"rank {rank} failed: {own[rank]}")
    if own:
        rank = min(own)
        return Cause(f"rank {rank} failed: {own[rank]}")
    for rank, why in exits:
        if why.startswith("exited") and rank not in errors:
            host = hosts[rank] if hosts and rank < len(hosts) else ""
            if why.endswith("code 255") and host not in ("", "127.0.0.1"):
                # ssh's own failure code: the rank never started there.
                return Cause(
                    f"rank {rank} could not be started on {host!r}: ssh failed (is it reachable?)"
                )
            return Cause(f"rank {rank} {why}", ended=True)
    if errors:
        rank = min(errors)
        return Cause(f"rank {rank} failed: {errors[rank]} (another rank stopped answering)")
    last = next((x for x in reversed(stderr_lines) if x.strip()), "")
    return Cause(f"{cause}" + (f": {last}" if last else ""))


def _rank_errors(line: str) -> list[tuple[int, str]]:
    """Every rank error (rank, message) in `line`, even glued to others' text.

    mlx.launch relays each rank's output in the pieces it reads, so a line the front
    end reads may hold another rank's (or the launcher's) text before or after an
    error, or two errors: each is read up to the end of its own JSON object.
    """
    found = []
    for piece in line.split(ERROR_MARK)[1:]:
        try:
            data, _ = _JSON.raw_decode(piece)
            found.append((int(data["rank"]), str(data["message"])))
        except (ValueError, KeyError, TypeError):
            continue
    return found


def _exit_cause(code: str | None) -> str:
    if code is None:
        return "terminated"
    n = int(code)
    if n == -signal.SIGTERM:
        return _TERMINATED_BY_SIGNAL
    if n < 0:
        try:
            return f"was killed by {signal.Signals(-n).name}"
        except ValueError:
            return f"was killed by signal {-n}"
    return f"exited with code {n}"
