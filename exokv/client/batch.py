"""A batch of turns on the ranks: one `batch` message out, each row's text and outcome back.

The rows travel in one message (the batch and its order are the front end's choice,
broadcast by rank 0 to every rank); each row has its own request id, which its text
pieces (`texts` messages, every row's pieces since the last one: exokv.rank.textflow),
progress and `row` messages carry, and which a `stop` names to end that row alone.
A row's stop is sent the moment it is asked for (`BatchRows.stop`, from whichever
thread learns the client left), not when the next message happens to be read.
Requests that join the batch in flight (`joins`, asked whenever a message comes or
the caller nudges the client) go to rank 0 in a `join` message under new ids, their
rows numbered after the rows before them; rank 0 admits them at its next decode step.
"""

from __future__ import annotations

import threading
from typing import Any

from exokv.core.records import NO_CALLS, BatchCalls, RowOutcome, TurnRequest
from exokv.errors import ExokvError
from exokv.wire.messages import Batch, BatchRow, Join, Row, Stop, Texts


class BatchRows:
    """The request ids of the batch in flight, and the stops sent for its rows (once each)."""

    def __init__(self, client: Any, ids: list[int]) -> None:
        self.client = client
        self.ids = ids
        self._stopped: set[int] = set()
        self._lock = threading.Lock()

    def stop(self, row: int) -> None:
        """End row `row` at its next decode step on every rank (any thread may call it)."""
        with self._lock:
            if row in self._stopped or not 0 <= row < len(self.ids):
                return
            self._stopped.add(row)
        try:
            self.client._send(Stop(self.ids[row]), fail=False)
        except ExokvError:  # the ranks are gone: the batch's own loop says so
            pass


def cluster_turns(
    client: Any,
    requests: list[TurnRequest],
    calls: BatchCalls = NO_CALLS,
) -> list[RowOutcome]:
    """Run `requests` as one batch on `client`'s ranks (a ClusterClient); outcomes in order
    (the joined rows' after), and each to on_row(row, outcome) as soon as it comes."""
    with client._in_flight():
        ids = [client._new_id() for _ in requests]
        rows = BatchRows(client, ids)
        row_of = {ident: i for i, ident in enumerate(ids)}
        batch = [BatchRow(ident, request) for ident, request in zip(ids, requests, strict=True)]
        client._send(Batch(client._new_id(), batch, join=calls.joins is not None))
        client._rows = rows
        try:
            return _collect(client, rows, row_of, calls)
        finally:
            client._rows = None


def _collect(
    client: Any,
    rows: BatchRows,
    row_of: dict[int, int],
    calls: BatchCalls,
) -> list[RowOutcome]:
    """Read the batch's messages until every row's outcome came."""
    on_text, should_stop, on_row, joins = (
        calls.on_text,
        calls.should_stop,
        calls.on_row,
        calls.joins,
    )
    outcomes: list[RowOutcome | None] = [None] * len(rows.ids)
    while any(o is None for o in outcomes):
        if joins is not None:
            _join(client, rows, row_of, outcomes, joins())
        # A stop asked without a push (a stop string, the server closing) is sent here.
        for i in range(len(outcomes)):
            if outcomes[i] is None and should_stop is not None and should_stop(i):
                rows.stop(i)
        message = client._next(idle=joins is not None)
        if message is None:  # nothing came for a while, or the caller nudged: ask joins
            continue
        if isinstance(message, Texts):  # the rows' pieces since the last texts message
            for ident, piece in message.pieces:
                if on_text is not None and ident in row_of:
                    on_text(row_of[ident], str(piece))
            continue
        if not isinstance(message, Row) or message.id not in row_of:
            continue  # progress, or about an earlier request whose caller gave up
        i = row_of[message.id]
        outcomes[i] = message.outcome
        result = message.outcome.result
        if result is not None and message.tokens:  # the reply's exact tokens, as a turn's
            result.reply_tokens = [int(t) for t in message.tokens]
        if on_row is not None:
            on_row(i, message.outcome)
    return [o for o in outcomes if o is not None]


def _join(
    client: Any,
    rows: BatchRows,
    row_of: dict[int, int],
    outcomes: list[RowOutcome | None],
    requests: list[TurnRequest],
) -> None:
    """Send `requests` to join the batch in flight, numbered after the rows before them."""
    if not requests:
        return
    joined = []
    for request in requests:
        ident = client._new_id()
        with rows._lock:  # a row's stop may be asked from another thread meanwhile
            row_of[ident] = len(rows.ids)
            rows.ids.append(ident)
        outcomes.append(None)
        joined.append(BatchRow(ident, request))
    client._send(Join(joined))
