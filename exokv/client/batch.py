"""A batch of turns on the ranks: one `batch` message out, each row's text and outcome back.

The rows travel in one message (the batch and its order are the front end's choice,
broadcast by rank 0 to every rank); each row has its own request id, which its text
pieces (one `texts` message per decode step, for every row), progress and `row`
messages carry, and which a `stop` names to end that row alone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from exokv.records import RowOutcome, TurnRequest, TurnResult


def cluster_turns(
    client: Any,
    requests: list[TurnRequest],
    on_text: Callable[[int, str], None] | None = None,
    should_stop: Callable[[int], bool] | None = None,
) -> list[RowOutcome]:
    """Run `requests` as one batch on `client`'s ranks (a ClusterClient); outcomes in order."""
    with client._in_flight():
        ids = [client._new_id() for _ in requests]
        row_of = {ident: i for i, ident in enumerate(ids)}
        pairs = zip(ids, requests, strict=True)
        rows = [{"id": ident, "request": request.to_dict()} for ident, request in pairs]
        client._send({"type": "batch", "id": client._new_id(), "rows": rows})
        outcomes: list[RowOutcome | None] = [None] * len(requests)
        stops_sent: set[int] = set()
        while any(o is None for o in outcomes):
            _send_stops(client, ids, outcomes, stops_sent, should_stop)
            message = client._next()
            if message["type"] == "texts":  # one decode step's pieces, every row's
                for ident, piece in message.get("pieces", []):
                    if on_text is not None and ident in row_of:
                        on_text(row_of[ident], str(piece))
                continue
            i = row_of.get(message.get("id"))
            if i is None:  # about an earlier request whose caller gave up
                continue
            kind = message["type"]
            if kind == "text" and on_text is not None:
                on_text(i, str(message.get("text", "")))
            elif kind == "row":
                outcomes[i] = _outcome(message["outcome"])
                result = outcomes[i].result
                if result is not None and message.get("tokens"):
                    client._keep_reply(result.reply, message["tokens"])
        return [o for o in outcomes if o is not None]


def _send_stops(
    client: Any,
    ids: list[int],
    outcomes: list[RowOutcome | None],
    sent: set[int],
    should_stop: Callable[[int], bool] | None,
) -> None:
    """A `stop` for each row that should stop now and was not told yet (once per row)."""
    if should_stop is None:
        return
    for i, ident in enumerate(ids):
        if i not in sent and outcomes[i] is None and should_stop(i):
            sent.add(i)
            client._send({"type": "stop", "id": ident}, fail=False)


def _outcome(data: dict[str, Any]) -> RowOutcome:
    result = data.get("result")
    return RowOutcome(
        result=TurnResult.from_dict(result) if result is not None else None,
        refused=data.get("refused"),
        tokens=int(data.get("tokens") or 0),
        context=int(data.get("context") or 0),
        batch=int(data.get("batch") or 1),
    )
