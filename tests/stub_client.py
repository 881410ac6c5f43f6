"""A client with every member of the `Client` Protocol and nothing behind them: the
test fakes subclass it and give the members they fake (turn, mostly)."""

from __future__ import annotations

from collections.abc import Callable

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


class StubClient:
    ranks = 1
    failure: str | None = None
    budgets: list[int | None] = [None]
    kv_per_token: list[int] = []
    model_context: int | None = None

    def turn(
        self,
        request: TurnRequest,
        on_text: Callable[[str], None] | None = None,
        on_progress: Callable[[int, int], None] | None = None,
    ) -> TurnResult:
        raise NotImplementedError("this fake runs no turns")

    def turns(
        self,
        requests: list[TurnRequest],
        calls: BatchCalls = NO_CALLS,
    ) -> list[RowOutcome]:
        raise NotImplementedError("this fake runs no batches")

    def stop(self) -> None:
        pass

    def stop_now(self) -> None:
        pass

    def stop_row(self, row: int) -> None:
        pass

    def release_thread(self) -> None:
        pass

    def draft(
        self, session: str, messages: list[dict[str, str]], text: str, wait: bool = False
    ) -> None:
        pass

    def draft_cost(self, session: str) -> DraftCost | None:
        return None

    def save_cache(self, session: str, messages: list[dict[str, str]]) -> CacheFileReport:
        return CacheFileReport(session=session, skipped="nothing cached")

    def cache_held(self, session: str, messages: list[dict[str, str]]) -> CacheFileReport:
        return CacheFileReport(session=session)

    def health(self) -> str | None:
        return None

    def hosts(self) -> list[HostState]:
        return []

    def change_hosts(self, add: str | None = None, drop: str | None = None) -> str:
        raise ExokvError("this fake runs on one machine")

    def close(self) -> None:
        pass


class Replies(StubClient):
    """Replies `text` to every turn, streamed in pieces of 5 characters, with the
    usage of a 30-token prompt of which the cache served 20; or raises `error` after
    streaming. `requests` keeps the turns it was asked for."""

    def __init__(self, text: str, finish: str = "stop", error: Exception | None = None) -> None:
        self.text = text
        self.finish = finish
        self.error = error
        self.requests: list[TurnRequest] = []

    def turn(
        self,
        request: TurnRequest,
        on_text: Callable[[str], None] | None = None,
        on_progress: Callable[[int, int], None] | None = None,
    ) -> TurnResult:
        self.requests.append(request)
        for i in range(0, len(self.text), 5):
            if on_text is not None:
                on_text(self.text[i : i + 5])
        if self.error is not None:
            raise self.error
        return TurnResult(
            request.session, self.text, 30, 20, 10, 7, 0.25, 28.0, 0.0, 1, finish_reason=self.finish
        )
