"""LocalClient: the engine in this process, one rank."""

from __future__ import annotations

import threading
from collections.abc import Callable

from exokv.engine import Engine, EngineOptions
from exokv.records import TurnRequest, TurnResult


class LocalClient:
    def __init__(self, model_name: str, options: EngineOptions) -> None:
        from exokv.model.resolve import load_model

        model, tokenizer = load_model(model_name)
        self.engine = Engine(model, tokenizer, options=options)
        self.ranks = 1
        self._stop = threading.Event()

    def turn(
        self,
        request: TurnRequest,
        on_text: Callable[[str], None] | None = None,
        on_progress: Callable[[int, int], None] | None = None,
    ) -> TurnResult:
        self._stop.clear()
        return self.engine.turn(request, on_text, on_progress, should_stop=self._stop.is_set)

    def stop(self) -> None:
        """Ask the reply being generated to end at the next token (Ctrl-C)."""
        self._stop.set()

    @property
    def budgets(self) -> list[int | None]:
        return [self.engine.budget]

    def close(self) -> None:
        pass
