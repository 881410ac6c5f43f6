"""How `exokv serve` stops: a drain that every open request sees the end of.

uvicorn's own shutdown cancels what is still running when its graceful timeout passes:
a stream's body just ends (the client reads a normal end), the ASGI task logs a
CancelledError, and the worker thread later posts to a closed event loop. Here the
drain is ours, before uvicorn's: on SIGTERM, SIGHUP or Ctrl-C the listeners close and
one line says how many requests are in flight; they get up to `drain_s` to finish;
then every turn still running is stopped on every rank (the queue's close, the caches
kept alike), so each stream ends with its own final chunk (an error event, a
finish_reason, `[DONE]`) and access line, and only then does uvicorn close what is left.

SIGTERM and SIGHUP after a drain in which everything finished exit 0 (the server did
what it was asked); one that had to stop requests exits 128 + the signal, as Ctrl-C
always does (130).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import threading
import time
from collections.abc import Callable, Generator
from types import FrameType
from typing import Any

import uvicorn

POLL_S = 0.05
# After the stop, how long the streams get to send their last chunks before uvicorn
# closes what is left (the ranks end a stopped turn within a decode step).
AFTER_STOP_S = 10.0
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class DrainingServer(uvicorn.Server):
    """uvicorn's server with exokv's drain (see the module docstring).

    `busy()`: whether requests are in flight (queued or running); `halt()`: stop them
    all on every rank and refuse the rest (blocking; run in a thread); `say`: the log.
    """

    def __init__(
        self,
        config: uvicorn.Config,
        drain_s: float,
        busy: Callable[[], int],
        halt: Callable[[], None],
        say: Callable[[str], None],
    ) -> None:
        super().__init__(config)
        self.drain_s = drain_s
        self.busy = busy
        self.halt = halt
        self.say = say
        self.signal: int | None = None  # the first signal that asked for the stop
        self.stopped = 0  # requests the drain limit stopped (0: a clean drain)
        self._again = False  # a second signal: stop what runs now

    @property
    def exit_code(self) -> int:
        """0, or 128 + the signal when it was Ctrl-C or the drain had to stop requests."""
        if self.signal is None:
            return 0
        if self.signal == signal.SIGINT or self.stopped:
            return 128 + self.signal
        return 0

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        # As uvicorn's, without raising the signal again once the server is down:
        # the exit code says how the drain went instead.
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.signal is None:
            self.signal = sig
        elif self.should_exit:
            self._again = True
        self.should_exit = True

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for server in self.servers:
            server.close()  # no new connections; those open finish what they asked
        for connection in list(self.server_state.connections):
            connection.shutdown()
        in_flight = self.busy()
        if in_flight:
            noun = "request" if in_flight == 1 else "requests"
            self.say(
                f"draining: {in_flight} {noun} in flight, up to {self.drain_s:g} s "
                "(then stopped on every rank)"
            )
        else:
            self.say("draining: no request in flight")
        deadline = time.monotonic() + self.drain_s
        while self._open() and time.monotonic() < deadline and not self._again:
            await asyncio.sleep(POLL_S)
        if self._open():
            self.stopped = max(self.busy(), 1)
            self.say(f"the drain limit passed: stopping {self.stopped} request(s) on every rank")
            await asyncio.to_thread(self.halt)
            deadline = time.monotonic() + AFTER_STOP_S
            while self.server_state.connections and time.monotonic() < deadline:
                await asyncio.sleep(POLL_S)
        else:
            await asyncio.to_thread(self.halt)  # nothing runs: the worker ends here
        await super().shutdown(sockets)

    def _open(self) -> bool:
        return bool(self.busy()) or any(_responding(c) for c in self.server_state.connections)


def _responding(connection: Any) -> bool:
    """Whether a connection is in the middle of a response (an idle keep-alive is not)."""
    cycle = getattr(connection, "cycle", None)
    return cycle is not None and not getattr(cycle, "response_complete", True)
