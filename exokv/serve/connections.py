"""Connections held to bounds: a client that never sends, or sends half a request, or
opens more connections than the server can keep, is closed, and said once.

uvicorn bounds none of it: its keep-alive timeout runs only between two requests and
starts again with every byte received, so a connection that sends nothing, or a byte
now and then, is held for ever, and enough of them use up the process's files (then
every accept fails, /health too). Here each connection (`GuardedH11Protocol`, uvicorn's
h11 protocol with deadlines) must send its request's head within `head_s` of opening
or of its previous response, and its body within `body_s` of its head (the app's own
body deadline answers a 408 a little earlier; this one closes what no handler reads);
past `max_connections` open at once, the one idle the longest (no request in flight)
is closed to make room, or the newcomer if every one is busy. A request in flight, a
long prefill or stream, has no deadline here. What is closed is said in one line per
cause at most every `every_s` seconds, with how many since (`Notices`), and uvicorn's
and asyncio's own warnings (an invalid request, an accept that failed) are held to
the same pace (`RateLimited`), without tracebacks.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from exokv.config import debug_enabled

HEAD_S = 10.0  # a request's head (its line and headers) must have come within this
BODY_S = 65.0  # its body within this of its head: the app answers a 408 at 60 s first
MAX_CONNECTIONS = 1024  # open at once at most (and half the process's file limit)
# Connections asyncio accepts at most in one pass of the loop (it takes uvicorn's
# backlog), before any of those closed to make room frees its file: with the cap,
# what the process can hold at once (uvicorn's default, 2048, would exceed mlx-lm's
# file limit of 2048 and fail accepts).
BACKLOG = 128
EVERY_S = 10.0  # one line per cause at most this often

# What each cause of a close says, after "closed N connection(s) ".
WHY = {
    "head": "that sent no request head within {head_s:g} s",
    "body": "that sent no whole request body within {body_s:g} s",
    "idle": "idle the longest, to keep at most {max_connections:,} open",
    "busy": "as they came: {max_connections:,} were open, each with a request in flight",
}


def default_max_connections() -> int:
    """MAX_CONNECTIONS, or half of what the process's open-file limit leaves past one
    pass of accepts (BACKLOG) if that is lower (mlx-lm sets 2048; a Mac's shell may
    start at 256): the rest stays for the ranks' channels, the store, the model's files."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return MAX_CONNECTIONS
    return max(16, min(MAX_CONNECTIONS, (soft - BACKLOG) // 2))


class Notices:
    """Lines said through `say`, one per cause at most every `every_s` seconds: the
    first at once, the ones that come sooner counted and said together when the
    interval has passed (on `loop`, so a burst's count is said even if nothing follows)."""

    def __init__(
        self, say: Callable[[str], None], every_s: float = EVERY_S, clock: Any = time.monotonic
    ) -> None:
        self.say = say
        self.every_s = every_s
        self.clock = clock
        self._last: dict[str, float] = {}  # cause -> when its last line was said
        self._held: Counter[str] = Counter()  # cause -> closes not said yet
        self._peer: dict[str, str] = {}  # cause -> the last close's peer
        self._line: dict[str, Callable[[int, str], str]] = {}
        self._flush_at: set[str] = set()  # causes with a flush scheduled

    def note(
        self, cause: str, line: Callable[[int, str], str], peer: str, loop: Any = None
    ) -> None:
        """One more of `cause`; `line(n, peer)` words n of them, the last from `peer`."""
        self._held[cause] += 1
        self._peer[cause] = peer
        self._line[cause] = line
        now = self.clock()
        last = self._last.get(cause)
        if last is None or now - last >= self.every_s:
            self._flush(cause)
        elif loop is not None and cause not in self._flush_at:
            self._flush_at.add(cause)
            loop.call_later(last + self.every_s - now, self._flush, cause)

    def _flush(self, cause: str) -> None:
        self._flush_at.discard(cause)
        n = self._held.pop(cause, 0)
        if n:
            self._last[cause] = self.clock()
            self.say(self._line[cause](n, self._peer[cause]))


@dataclass
class Guard:
    """The bounds every connection is held to, and where what they close is said."""

    notices: Notices
    head_s: float = HEAD_S
    body_s: float = BODY_S
    max_connections: int = field(default_factory=default_max_connections)

    def closed(self, cause: str, peer: str, loop: Any) -> None:
        why = WHY[cause].format(**vars(self))

        def line(n: int, last: str) -> str:
            return f"closed {n:,} connection{'s' if n > 1 else ''} {why} (the last: {last})"

        self.notices.note(cause, line, peer, loop)


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the deadlines and the cap of `guard` (a subclass's)."""

    guard: Guard

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        self._phase: str | None = None  # "head", "body", or None: nothing awaited
        self.idle_since = time.monotonic()  # when it last had no request in flight

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.guard.max_connections:
            self._make_room()
        if not transport.is_closing():
            self._watch()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    @property
    def peer(self) -> str:
        return f"{self.client[0]}:{self.client[1]}" if self.client else "-"

    def in_flight(self) -> bool:
        """Whether a request of this connection is being read or answered."""
        cycle = self.cycle
        return self._phase == "body" or (cycle is not None and not cycle.response_complete)

    def _watch(self) -> None:
        """The deadline of what the connection now awaits from its client: a request's
        head (idle), the rest of its body, or nothing (a request being answered)."""
        state = self.conn.their_state
        phase = "head" if state is h11.IDLE else "body" if state is h11.SEND_BODY else None
        if phase == self._phase or self.transport.is_closing():
            return
        self._disarm()
        self._phase = phase
        if phase == "head":
            self.idle_since = time.monotonic()
        if phase is not None:
            seconds = self.guard.head_s if phase == "head" else self.guard.body_s
            self._deadline = self.loop.call_later(seconds, self._expired, phase)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self, phase: str) -> None:
        self._deadline = None
        if not self.transport.is_closing():
            self.guard.closed(phase, self.peer, self.loop)
            self.transport.close()

    def _make_room(self) -> None:
        """Over the cap: close the connection idle the longest, or this one."""
        open_ = [c for c in self.connections if not c.transport.is_closing()]
        if len(open_) <= self.guard.max_connections:
            return  # the ones over it are closing already
        idle = [c for c in open_ if c is not self and isinstance(c, GuardedH11Protocol)]
        idle = [c for c in idle if not c.in_flight()]
        if idle:
            oldest = min(idle, key=lambda c: c.idle_since)
            self.guard.closed("idle", oldest.peer, self.loop)
            oldest.transport.close()
        else:
            self.guard.closed("busy", self.peer, self.loop)
            self.transport.close()


def guarded_protocol(guard: Guard) -> type[GuardedH11Protocol]:
    """The protocol class uvicorn's `http` option takes, bound to `guard`."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"guard": guard})


class RateLimited(logging.Filter):
    """A logger's records, one per message at most every `every_s` seconds, on one
    line: uvicorn warns of each invalid request and asyncio of each failed accept (with
    a traceback), which a client sending garbage, or files running out, repeats
    thousands of times a second."""

    def __init__(
        self, every_s: float = EVERY_S, clock: Any = time.monotonic, tracebacks: bool = False
    ) -> None:
        super().__init__()
        self.every_s = every_s
        self.clock = clock
        self.tracebacks = tracebacks  # kept (EXOKV_DEBUG=1): the line, then its traceback
        self._last: dict[str, float] = {}
        self._dropped: Counter[str] = Counter()

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        key = text.partition("\n")[0]
        now = self.clock()
        last = self._last.get(key)
        if last is not None and now - last < self.every_s:
            self._dropped[key] += 1
            return False
        self._last[key] = now
        line = key
        if record.exc_info and record.exc_info[1] is not None:
            error = record.exc_info[1]
            line += f": {type(error).__name__}: {error}"
        dropped = self._dropped.pop(key, 0)
        if dropped:
            line += f" ({dropped:,} more like it in the last {now - last:.0f} s not logged)"
        record.msg, record.args = line, None
        if not self.tracebacks:
            record.exc_info, record.exc_text, record.stack_info = None, None, None
        return True


def hold_logs_to_pace(every_s: float = EVERY_S) -> None:
    """uvicorn's warnings and asyncio's errors through `RateLimited` (once per process;
    their tracebacks kept with EXOKV_DEBUG=1)."""
    for name in ("uvicorn.error", "asyncio"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, RateLimited) for f in logger.filters):
            logger.addFilter(RateLimited(every_s, tracebacks=debug_enabled()))
