"""LocalClient: the engine in this process, one rank.

Its module imports the engine (mlx, mlx-lm) at the top: `make_client` imports it only
for a chat that runs the model here.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable

import mlx.core as mx

from exokv.client import Client
from exokv.client.typeahead import DraftRunner
from exokv.core.records import (
    NO_CALLS,
    BatchCalls,
    CacheFileReport,
    DraftCost,
    HostState,
    RowOutcome,
    TurnRequest,
    TurnResult,
)
from exokv.errors import ExokvError
from exokv.model.resolve import load_model
from exokv.rank import kvsave
from exokv.rank.batch import run_batch
from exokv.rank.draft_model import load_draft
from exokv.rank.engine import Engine, EngineOptions


def forget_thread() -> None:
    """Free what MLX keeps for the calling thread (its streams and compile cache): a
    thread that ran the model calls this before it ends (exokv.client.typeahead)."""
    clear = getattr(mx, "clear_streams", None)  # mlx 0.32 and later
    if clear is not None:
        clear()


class LocalClient(Client):
    failure: str | None = None  # no ranks to lose: an error here is the turn's alone

    def __init__(
        self, model_name: str, options: EngineOptions, draft_model: str | None = None
    ) -> None:
        model, tokenizer = load_model(model_name)
        draft = None
        if draft_model is not None:
            draft = load_draft(draft_model, tokenizer)
        # The messages carry replies' tokens (exokv.prompt.render): nothing kept by text.
        self.engine = Engine(model, tokenizer, options=options, draft=draft, replies_by_text=False)
        if self.engine.template.note:  # a fallback template: said once, as the ranks' is
            print(f"exokv: {self.engine.template.note}", file=sys.stderr, flush=True)
        self.ranks = 1
        self._stop = threading.Event()
        self._engine_lock = threading.Lock()  # drafts run in a thread of their own
        self._drafts = DraftRunner(self.engine.typeahead_step, self._engine_lock, forget_thread)

    def turn(
        self,
        request: TurnRequest,
        on_text: Callable[[str], None] | None = None,
        on_progress: Callable[[int, int], None] | None = None,
    ) -> TurnResult:
        self._stop.clear()
        self._drafts.cancel()  # the step in flight finishes (and is used), no more after it
        with self._engine_lock:
            return self.engine.turn(request, on_text, on_progress, should_stop=self._stop.is_set)

    def draft(
        self, session: str, messages: list[dict[str, str]], text: str, wait: bool = False
    ) -> None:
        serial = self._drafts.submit(session, messages, text)
        if wait:
            self._drafts.wait(serial)

    def draft_cost(self, session: str) -> DraftCost | None:
        # Set by the drafts' thread after each step; a read of one attribute needs no lock.
        cost = self.engine.last_draft
        return cost if cost is not None and cost.session == session else None

    def turns(
        self,
        requests: list[TurnRequest],
        calls: BatchCalls = NO_CALLS,
    ) -> list[RowOutcome]:
        return run_batch(
            self.engine,
            requests,
            calls.on_text,
            should_stop=calls.should_stop,
            on_row=calls.on_row,
            joins=calls.joins,
        )

    def stop(self) -> None:
        """Ask the reply being generated to end at the next token (Ctrl-C)."""
        self._stop.set()

    def stop_now(self) -> None:
        self._stop.set()

    def stop_row(self, row: int) -> None:
        """Nothing to send: run_batch asks should_stop(row) in this process every step."""

    @property
    def budgets(self) -> list[int | None]:
        return [self.engine.budget]

    @property
    def kv_per_token(self) -> list[int]:
        return [self.engine.bytes_per_token]

    @property
    def model_context(self) -> int | None:
        return self.engine.context

    # -- /save and resuming (exokv.rank.kvsave): the disk tier ----------------------

    def save_cache(self, session: str, messages: list[dict[str, str]]) -> CacheFileReport:
        """Write the conversation's cached path to the disk tier and persist the tree."""
        self._drafts.cancel()
        with self._engine_lock:
            report = kvsave.save_session(self.engine, session, messages)
        tier = self.engine.coord.tier
        if tier is not None and report.tokens and tier.store.failed:
            report.warning = tier.store.failed
        return report

    def cache_held(self, session: str, messages: list[dict[str, str]]) -> CacheFileReport:
        """How much of a resumed conversation the restored tree holds."""
        with self._engine_lock:
            return kvsave.on_disk(self.engine, session, messages)

    def nudge(self) -> None:
        """Nothing to wake: in one process the batch asks `joins` at every step."""

    def release_thread(self) -> None:
        """A thread of the caller's that ran turns is about to end (a server's worker)."""
        forget_thread()

    def health(self) -> str | None:
        return None  # the model runs in this process: up while it runs

    def hosts(self) -> list[HostState]:
        return []  # this machine alone

    def change_hosts(self, add: str | None = None, drop: str | None = None) -> str:
        raise ExokvError(
            "this chat runs on one machine: /hosts add and drop need --hosts or --hostfile"
        )

    def close(self) -> None:
        self._drafts.close()
        with self._engine_lock:
            self.engine.close()
