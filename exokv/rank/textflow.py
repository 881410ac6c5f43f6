"""Rank 0's text of a batch's decode steps to the front end, never far ahead of it.

Each decode step's pieces are added here. One `texts` message is in flight at a
time: the next carries every piece made since (a row's pieces joined), once the front
end says it has handled the last one (`seen`). A slow front end so gets fewer, larger
messages instead of a backlog it reads seconds behind the ranks. And when the message
in flight is more than `window` steps old, rank 0 waits for it (so the batch waits):
a front end that stalls stalls the decode, and the stop it sends for a client that
left reaches rank 0 within `window` steps of the last text that client could have seen.

Only when rank 0 decodes depends on this, never which tokens: the ranks' decisions
are unchanged.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from exokv.wire.messages import Texts

WINDOW = 8  # decode steps rank 0 may run past the text message in flight
SEEN_POLL_S = 0.5  # a wait looks this often whether the front end is gone


class TextFlow:
    """The pieces of a batch's decode steps, sent to the front end at its pace."""

    def __init__(self, send: Callable[[Texts], None], window: int = WINDOW) -> None:
        self._send = send
        self.window = window
        self._turned = threading.Condition()
        self._step = 0  # decode steps so far, over every batch
        self._sent = 0  # the step of the last texts message
        self._seen = 0  # the last step the front end has handled
        self._gone = False  # the front end: nothing to wait for
        self._pending: dict[Any, str] = {}  # row id -> text not sent yet

    def add(self, ident: Any, piece: str) -> None:
        if piece:
            self._pending[ident] = self._pending.get(ident, "") + piece

    def seen(self, step: int) -> None:
        """The front end has handled the texts message of `step` (its reader thread)."""
        with self._turned:
            self._seen = max(self._seen, step)
            self._turned.notify_all()

    def gone(self) -> None:
        """The front end went away: never wait for it again."""
        with self._turned:
            self._gone = True
            self._turned.notify_all()

    def step(self) -> None:
        """One decode step is over: send its text if nothing is in flight; wait while
        the message in flight is more than `window` steps behind."""
        self._step += 1
        with self._turned:
            while self._in_flight() and self._step - self._sent > self.window and not self._gone:
                self._turned.wait(SEEN_POLL_S)
            if self._pending and not self._in_flight():
                self._flush()

    def flush(self) -> None:
        """Send what is pending now (the batch is over: its rows' results come next)."""
        with self._turned:
            if self._pending:
                self._flush()

    def _in_flight(self) -> bool:
        return self._sent > self._seen and not self._gone

    def _flush(self) -> None:
        pieces = [[ident, text] for ident, text in self._pending.items()]
        self._pending.clear()
        self._sent = self._step
        self._send(Texts(self._step, pieces))
