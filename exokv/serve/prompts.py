"""A request's prompt tokens counted in the front end, as the ranks would render them.

POST /v1/messages/count_tokens runs no turn, and the ranks take no other message
while a batch decodes, so the front end renders the request itself: the same
tokenizer files the ranks load (exokv.model.loading), the same template they settle
on (exokv.model.templates, from the same --chat-template spec), the same renderer
(exokv.prompt.render over exokv.prompt.markers's marker messages, which say tools and raw
prompts), and each echoed reply as the tokens the store keeps for it, given to the
request's messages as the turn's are (exokv.serve.replies).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from exokv.core.records import TurnRequest
from exokv.model import templates
from exokv.prompt.markers import Marked
from exokv.prompt.render import PromptRenderer
from exokv.serve.errors import ApiError
from exokv.serve.tools import model_files

Messages = Callable[[TurnRequest], list[dict[str, Any]]]


class FrontRender:
    """The renderer of model `name`'s prompts under template `spec`, loaded on first use;
    `replies(request)`: the request's messages, each reply with the tokens known for it."""

    def __init__(self, name: str, spec: str | None, replies: Messages) -> None:
        self.name = name
        self.spec = spec
        self.replies = replies
        self._lock = threading.Lock()  # one render at a time: the renderer keeps renders
        self._renderer: Any = None

    def _load(self) -> Any:
        # exokv.model.loading imports mlx (and the tokenizer transformers): seconds the
        # server's start must not pay; only a count loads them.
        from exokv.model.loading import load_tokenizer

        try:
            tokenizer, config = load_tokenizer(model_files(self.name))
            settled = templates.settle(tokenizer, config.get("model_type"), self.spec)
        except Exception as err:  # noqa: BLE001 - one line for the client, not a traceback
            raise ApiError(
                500,
                f"cannot count tokens here: the model's tokenizer did not load in the server "
                f"({type(err).__name__}: {err})"[:400],
            ) from None
        return PromptRenderer(Marked(tokenizer), settled.text)

    def tokens(self, request: TurnRequest) -> list[int]:
        """The prompt tokens of `request`'s turn."""
        with self._lock:
            if self._renderer is None:
                self._renderer = self._load()
            return self._renderer.render(self.replies(request))

    def count(self, request: TurnRequest) -> int:
        return len(self.tokens(request))
