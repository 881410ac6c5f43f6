"""LocalClient: the engine in this process, one rank."""

from __future__ import annotations

import threading
from collections.abc import Callable

from exokv.client import Client
from exokv.rank import kvsave
from exokv.rank.engine import Engine, EngineOptions
from exokv.rank.kvsave import CacheFileReport
from exokv.records import TurnRequest, TurnResult


class LocalClient(Client):
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

    # -- replies' exact tokens (Engine.render shows the model what it generated) ------

    def reply_tokens(self, reply: str) -> list[int] | None:
        return self.engine.reply_tokens(reply)

    def remember_replies(self, pairs: list[tuple[str, list[int]]]) -> None:
        self.engine.remember_replies(pairs)

    # -- /save and resuming (exokv.rank.kvsave): the disk tier ----------------------

    def save_cache(self, session: str, messages: list[dict[str, str]]) -> CacheFileReport:
        """Write the conversation's cached path to the disk tier and persist the tree."""
        report = kvsave.save_session(self.engine, session, messages)
        tier = self.engine.coord.tier
        if tier is not None and report.tokens and tier.store.failed:
            report.warning = tier.store.failed
        return report

    def cache_held(self, session: str, messages: list[dict[str, str]]) -> CacheFileReport:
        """How much of a resumed conversation the restored tree holds."""
        return kvsave.on_disk(self.engine, session, messages)

    def close(self) -> None:
        self.engine.close()
