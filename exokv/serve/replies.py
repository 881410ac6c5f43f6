"""The one place the server gives a request's replies their exact tokens: the store's.

A client resends the whole conversation with each call, text only. The ranks render
each earlier reply as the tokens its message carries (exokv.prompt.render), and remember
nothing; re-encoding the text can give other tokens, which would miss the cache from
the reply on and change the reply at temperature 0. The store keeps those tokens with
every assistant message it records (messages.tokens, as for the chat). So before a
request runs, each of its replies that carries no tokens is given those stored for the
same text in its conversation's session (in the worker thread), and the request goes
on with them: the same prompt as the chat's, after a restart of the server or its
ranks alike. The turn is timed here too, from the request's hand-over
(exokv.client.stopwatch).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from exokv.client.stopwatch import FirstText
from exokv.core.records import NO_CALLS, BatchCalls, RowOutcome, TurnRequest, TurnResult
from exokv.prompt.render import with_reply_tokens

Message = dict[str, Any]


class RepliesFromStore:
    """A client whose requests' replies carry the tokens the store keeps for them.
    `stored(session)`: (reply, tokens) pairs of a session."""

    def __init__(self, inner: Any, stored: Callable[[str], list[tuple[str, list[int]]]]) -> None:
        self._inner = inner
        self._stored = stored

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def with_tokens(self, request: TurnRequest) -> TurnRequest:
        """`request`, its replies without tokens given the stored ones for their text."""
        wanted = _bare_replies(request.messages)
        if not wanted:
            return request
        stored = {r: t for r, t in self._stored(request.session) if r in wanted}
        if not stored:
            return request
        messages = [
            with_reply_tokens(m, stored.get(m["content"])) if _is_bare_reply(m) else m
            for m in request.messages
        ]
        return dataclasses.replace(request, messages=messages)

    def known(self, request: TurnRequest) -> list[Message]:
        """The request's messages as its turn would render them (exokv.serve.prompts)."""
        return self.with_tokens(request).messages

    def turn(
        self,
        request: TurnRequest,
        on_text: Callable[[str], None] | None = None,
        on_progress: Callable[[int, int], None] | None = None,
    ) -> TurnResult:
        shown = FirstText(on_text)  # the TTFT, from the request's hand-over
        result = self._inner.turn(self.with_tokens(request), on_text=shown, on_progress=on_progress)
        return shown.stamp(result)

    def turns(
        self,
        requests: list[TurnRequest],
        calls: BatchCalls = NO_CALLS,
    ) -> list[RowOutcome]:
        joined, joins = None, calls.joins
        if joins is not None:  # requests that join the batch in flight get theirs too

            def joined() -> list[TurnRequest]:
                return [self.with_tokens(r) for r in joins()]

        return self._inner.turns(
            [self.with_tokens(r) for r in requests], replace(calls, joins=joined)
        )


def _is_bare_reply(message: Message) -> bool:
    return (
        message["role"] == "assistant"
        and "tokens" not in message
        and isinstance(message.get("content"), str)
        and bool(message["content"])
    )


def _bare_replies(messages: Sequence[Message]) -> set[str]:
    """The texts of a conversation's replies that carry no tokens."""
    return {m["content"] for m in messages if _is_bare_reply(m)}
