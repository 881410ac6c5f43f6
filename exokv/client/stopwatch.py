"""A turn's time to first token as its user sees it: from the request (Enter) to the
first text handed to the front end.

The engine's own clock starts when the turn reaches it, after whatever ran before: the
typeahead step in flight (which Enter waits for), the trip to rank 0, the ranks started
again after a failure. A user waits for all of it, so the turn is timed once, where the
front end hands it to its client: `ChatController` for the chat (the REPL, scripts, a
one-shot prompt), `RepliesFromStore` for the server (exokv.serve.replies). No client
times it (a HealingClient's restart is inside the front end's stopwatch).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from exokv.core.records import TurnResult


class FirstText:
    """Wraps a turn's on_text; `stamp` puts the time to its first text in the result."""

    def __init__(self, on_text: Callable[[str], None] | None) -> None:
        self.start = time.perf_counter()
        self.first: float | None = None
        self._on_text = on_text

    def __call__(self, piece: str) -> None:
        if piece and self.first is None:
            self.first = time.perf_counter()
        if self._on_text is not None:
            self._on_text(piece)

    def stamp(self, result: TurnResult) -> TurnResult:
        if self.first is not None:
            result.ttft_s = self.first - self.start
        elif result.generated_tokens:  # a reply with no text (an end of turn at once)
            result.ttft_s = time.perf_counter() - self.start
        return result
