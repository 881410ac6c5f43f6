"""Rank 0's box of requests that join the batch in flight (`join` messages).

The front end sends a `join` while it waits on a batch; rank 0's channel thread puts
it here, and the batch takes what is here at its next decode step (and broadcasts it
in the step's collectives, so every rank admits the same rows at the same step). A
join that comes when no batch can take it (the batch just ended, or it runs one row at
a time) is not lost: when the batch closes the box, what is left, or the first join
that comes while no batch runs, goes to rank 0's inbox as a batch of its own, which the
front end, still waiting for those rows, reads like any other; joins that come after
it, until a batch opens the box, wait here and join that batch at its first step (not
one batch each, one after another).
"""

from __future__ import annotations

import queue
import threading

from exokv.wire.messages import Batch, BatchRow, Join, Message


class JoinBox:
    def __init__(self, inbox: queue.Queue[Message]) -> None:
        self._inbox = inbox
        self._rows: list[BatchRow] = []
        self._open = False
        self._late = False  # a batch of late rows is in the inbox: later ones join it
        self._lock = threading.Lock()

    def put(self, message: Join) -> None:
        """A join from the front end (the channel thread)."""
        if not message.rows:
            return
        with self._lock:
            if self._open or self._late:
                self._rows += message.rows
                return
            self._late = True
        self._inbox.put(Batch(message.rows[0].id, list(message.rows), join=True))

    def open(self) -> None:
        with self._lock:
            self._open, self._late = True, False

    def take(self) -> list[BatchRow]:
        """The rows that came since the last take, in the order they came."""
        with self._lock:
            rows, self._rows = self._rows, []
        return rows

    def close(self) -> None:
        """The batch ends: rows not taken run as a batch of their own, next."""
        with self._lock:
            self._open = False
            rows, self._rows = self._rows, []
            self._late = bool(rows)
        if rows:
            self._inbox.put(Batch(rows[0].id, rows, join=True))
