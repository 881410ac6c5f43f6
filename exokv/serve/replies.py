"""The replies' exact tokens a restarted server gives back to its ranks.

A client resends the whole conversation with each call, so the server renders each
earlier reply from its text; the ranks render it as the tokens they generated while
they remember them (exokv.prompt.render), and the store keeps those tokens with every
assistant message it records (messages.tokens, as for the chat). A server started
again knows none of them: re-encoding the text can give other tokens, the disk
tier's entry for the conversation is missed from the reply on, and the reply at
temperature 0 changes. So before a request runs, the assistant messages the ranks
do not know are looked up in its conversation's stored session and handed to them,
in the worker thread, as the chat does when it resumes a session.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from exokv.core.records import RowOutcome, TurnRequest, TurnResult
from exokv.serve.prompts import assistant_replies


class RepliesFromStore:
    """A client that, before each turn, restores the stored tokens of the request's
    replies it does not know. `stored(session)`: (reply, tokens) pairs of a session."""

    def __init__(self, inner: Any, stored: Callable[[str], list[tuple[str, list[int]]]]) -> None:
        self._inner = inner
        self._stored = stored

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def _unknown(self, request: TurnRequest) -> list[tuple[str, list[int]]]:
        """The stored tokens of the request's replies the ranks do not know."""
        unknown = {
            r for r in assistant_replies(request.messages) if self._inner.reply_tokens(r) is None
        }
        if not unknown:
            return []
        return [(r, t) for r, t in self._stored(request.session) if r in unknown]

    def known(self, request: TurnRequest) -> list[tuple[str, list[int]]]:
        """The exact tokens of every reply of the request known here: the ranks' (as the
        client keeps them), else the store's; what the turn would render them as."""
        pairs = []
        for reply in assistant_replies(request.messages):
            tokens = self._inner.reply_tokens(reply)
            if tokens is not None:
                pairs.append((reply, tokens))
        return pairs + self._unknown(request)

    def restore(self, requests: list[TurnRequest]) -> int:
        """Give the ranks the stored tokens of the requests' unknown replies; how many."""
        pairs = [pair for request in requests for pair in self._unknown(request)]
        if pairs:
            self._inner.remember_replies(pairs)
        return len(pairs)

    def turn(
        self,
        request: TurnRequest,
        on_text: Callable[[str], None] | None = None,
        on_progress: Callable[[int, int], None] | None = None,
    ) -> TurnResult:
        self.restore([request])
        return self._inner.turn(request, on_text=on_text, on_progress=on_progress)

    def turns(
        self,
        requests: list[TurnRequest],
        on_text: Callable[[int, str], None] | None = None,
        should_stop: Callable[[int], bool] | None = None,
        on_row: Callable[[int, RowOutcome], None] | None = None,
        joins: Callable[[], list[TurnRequest]] | None = None,
    ) -> list[RowOutcome]:
        # Requests that join the batch while it runs are not restored: the ranks take
        # no other message mid-batch. Their echoed replies are rendered from the text.
        self.restore(requests)
        return self._inner.turns(
            requests, on_text=on_text, should_stop=should_stop, on_row=on_row, joins=joins
        )
