"""A rank that dies is replaced, and the chat goes on: HealingClient.

It runs turns on a ClusterClient; when the ranks fail (a rank exits, is killed or
stops answering, which the ClusterClient finds out and ends what is left of them),
it says so in one line, starts the ranks again with the same layout — at most
`restarts` tries in a row, waiting 1, 2, 4 ... seconds between them — and runs the
request in flight again. The new ranks need nothing handed to them: each reply's
exact tokens travel with its message in every request (exokv.prompt.render).
The new ranks start warm from their disk tiers and journals (exokv.cache.journal),
so the retried turn prefills only what the last finished turn had not cached.

A start that fails every try asks whether a host is gone: one whose ssh server does
not answer at the end of the tries (a Mac closed, off the network, rebooting for
longer than the tries take; one that answers is never taken for gone, however
busy). Then the ranks are placed again on the hosts left (exokv.client.replan) and
the request in flight runs on them, with one line saying so and how much of its
prompt the cache kept. With no host gone, or none left that the model fits on, the
chat ends in one line, its turns stored.

Between requests (the user at the prompt) the ClusterClient's watcher wakes the main
thread only while its own SIGUSR1 handler is installed; this client installs one
that does nothing, so a failure found at the prompt is said at once by a thread of
ours and healed by the next request, instead of ending the chat.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import TypeVar

from exokv.client.cluster import ClusterClient
from exokv.client.replan import replan, with_host
from exokv.core.options import ClusterOptions
from exokv.core.records import (
    NO_CALLS,
    BatchCalls,
    CacheEvent,
    CacheFileReport,
    DraftCost,
    HostState,
    RowOutcome,
    TurnRequest,
    TurnResult,
)
from exokv.errors import ExokvError
from exokv.launch.command import unreachable
from exokv.launch.supervise import Cause

T = TypeVar("T")
BACKOFF_S = 1.0  # the wait before the first restart; doubled for each next one


class HealingClient:
    failure: str | None = None  # never set: the next request heals what failed

    def __init__(
        self,
        start: Callable[[ClusterOptions], ClusterClient],
        opts: ClusterOptions,
        say: Callable[[str], None] | None = None,
    ) -> None:
        self._start_with = start
        self.opts = opts  # what the ranks run with now (a re-plan changes the hosts)
        self.restarts = opts.restarts
        self._say = say or (lambda text: print(f"exokv: {text}", file=sys.stderr, flush=True))
        self._inner = start(opts)
        self.ranks = self._inner.ranks
        self._replanned = ""  # the line of a re-plan, said with the next turn's cache
        self._left: dict[str, str] = {}  # hosts no longer in the plan: "gone" or "dropped"
        self._said: Cause | None = None  # the failure already said, once
        self._lock = threading.Lock()  # _said and _busy, between the notifier and main
        self._busy = False  # a request is in flight: it says and heals a failure itself
        self._restarted: list[str] = []  # why, for the next turn's events
        self._heal_lock = threading.Lock()  # one restart at a time (a request's or the watch's)
        self._restarting: Cause | None = None  # a restart under way, for health()
        # Start the ranks again as soon as they are found dead while idle (a server: the
        # next request should not pay for it), not only with the next request (the chat).
        self.heal_when_idle = False
        self._quiet_watcher()

    # -- the client interface ----------------------------------------------------

    @property
    def budgets(self) -> list[int | None]:
        return self._inner.budgets

    @property
    def kv_per_token(self) -> list[int]:
        return self._inner.kv_per_token

    @property
    def model_context(self) -> int | None:
        return self._inner.model_context

    def turn(
        self,
        request: TurnRequest,
        on_text: Callable[[str], None] | None = None,
        on_progress: Callable[[int, int], None] | None = None,
    ) -> TurnResult:
        shown = ShownOnce(on_text)

        def run(inner: ClusterClient) -> TurnResult:
            shown.rerun()
            return inner.turn(request, shown, on_progress)

        result = self._healing(run)
        for why in self._restarted:  # shown with the turn and kept with its events
            result.events.insert(0, _restart_event(why, result.decision, result.ranks))
        self._restarted = []
        if self._replanned:
            kept = f"{result.cached_tokens:,} of {result.prompt_tokens:,} tokens"
            self._say(f"{self._replanned}; cache kept: {kept}")
            self._replanned = ""
        return result

    def turns(
        self,
        requests: list[TurnRequest],
        calls: BatchCalls = NO_CALLS,
    ) -> list[RowOutcome]:
        # A batch the ranks die in runs again whole on the new ranks, as a turn does,
        # with the rows that had joined it; a row answered before they died is not
        # answered again.
        on_text, on_row, joins = calls.on_text, calls.on_row, calls.joins
        requests = list(requests)
        rows = [ShownOnce(partial(on_text, i) if on_text else None) for i in range(len(requests))]
        answered: set[int] = set()

        def joined() -> list[TurnRequest]:
            assert joins is not None
            more = joins()
            for _ in more:
                rows.append(ShownOnce(partial(on_text, len(rows)) if on_text else None))
            requests.extend(more)
            return more

        def answer(row: int, outcome: RowOutcome) -> None:
            if on_row is not None and row not in answered:
                answered.add(row)
                on_row(row, outcome)

        def run(inner: ClusterClient) -> list[RowOutcome]:
            for row in rows:
                row.rerun()
            relay = (lambda row, piece: rows[row](piece)) if on_text else None
            heard = BatchCalls(relay, calls.should_stop, answer, joined if joins else None)
            return inner.turns(list(requests), heard)

        return self._healing(run)

    def stop(self) -> None:
        self._inner.stop()

    def stop_now(self) -> None:
        self._inner.stop_now()

    def stop_row(self, row: int) -> None:
        self._inner.stop_row(row)

    def nudge(self) -> None:
        self._inner.nudge()

    def release_thread(self) -> None:
        self._inner.release_thread()

    def draft(
        self, session: str, messages: list[dict[str, str]], text: str, wait: bool = False
    ) -> None:
        # A head start only: ranks that failed are healed by the next request, not here.
        self._inner.draft(session, messages, text, wait)

    def draft_cost(self, session: str) -> DraftCost | None:
        return self._inner.draft_cost(session)

    def save_cache(self, session: str, messages: list[dict[str, str]]) -> CacheFileReport:
        return self._healing(lambda c: c.save_cache(session, messages))

    def cache_held(self, session: str, messages: list[dict[str, str]]) -> CacheFileReport:
        return self._healing(lambda c: c.cache_held(session, messages))

    def close(self) -> None:
        self._inner.close()

    def health(self) -> str | None:
        """Why the ranks cannot take a request now, in words; None when they can."""
        restarting = self._restarting
        if restarting is not None:
            return f"{restarting.text}; the ranks are starting again"
        cause = self._inner.cause
        return None if cause is None else f"{cause.text}; the ranks are down"

    # -- healing -------------------------------------------------------------------

    def _healing(self, call: Callable[[ClusterClient], T]) -> T:
        with self._lock:
            self._busy = True
        try:
            runs = 0
            while True:
                runs += 1
                with self._heal_lock:  # a restart the watch began is waited for
                    inner = self._inner
                try:
                    return call(inner)
                except ExokvError as err:
                    cause = inner.cause
                    if cause is None:
                        raise  # not the ranks: a refused turn, a message too large
                    if runs > self.restarts:
                        # The request itself fails the ranks (a rank's own error on it):
                        # starting them again would go on for ever.
                        raise ExokvError(
                            f"{err}; the request failed the ranks {runs} times in a row"
                        ) from None
                self._heal(cause, inner)
        finally:
            with self._lock:
                self._busy = False

    def _say_once(self, cause: Cause, text: str) -> None:
        with self._lock:
            if self._said == cause:
                return
            self._said = cause
        self._say(text)

    def _heal(self, cause: Cause, inner: ClusterClient) -> None:
        with self._heal_lock:
            if inner is not self._inner:
                return  # started again meanwhile (by the watch)
            self._restarting = cause
            try:
                self._restart(cause)
            finally:
                self._restarting = None

    def _restart(self, cause: Cause) -> None:
        self._say_once(cause, f"{cause.text}; starting the ranks again")
        self._inner.close()
        last = ""
        for attempt in range(self.restarts):
            time.sleep(BACKOFF_S * 2**attempt)
            try:
                inner = self._start_with(self.opts)
            except ExokvError as err:
                last = str(err)
                continue
            self._started(inner, f"{cause.text}; ranks started again (try {attempt + 1})")
            return
        tries = f"{self.restarts} tr{'y' if self.restarts == 1 else 'ies'}"
        failed = f"{cause.text}; the ranks did not start again in {tries}: {last}"
        gone = self._gone()
        if not gone:
            raise ExokvError(failed)
        moved = replan(self.opts, gone)
        try:
            inner = self._start_with(moved.opts)
        except ExokvError as err:
            raise ExokvError(f"{moved.said}, but the ranks did not start there: {err}") from None
        self._left.update(dict.fromkeys(gone, "gone"))
        self.opts = moved.opts
        self._started(inner, moved.said)
        with self._lock:
            busy = self._busy
        if busy:  # said once the turn in flight ends, with how much of it was cached
            self._replanned = moved.said
        else:  # found while idle (a server between requests): said now
            self._say(moved.said)

    # -- /hosts: the hosts, and one taken on or left out between turns ------------------

    def hosts(self) -> list[HostState]:
        now = self._inner.hosts()
        here = {h.host for h in now}
        return now + [HostState(h, state) for h, state in self._left.items() if h not in here]

    def change_hosts(self, add: str | None = None, drop: str | None = None) -> str:
        """Between turns: the ranks placed again with `add` taken on or `drop` left out,
        started there; on a failure the ranks start again as they were."""
        if self.opts.hosts is None:
            raise ExokvError(
                "ranks on this machine: /hosts add and drop need --hosts or --hostfile"
            )
        names = [h.ssh for h in self.opts.hosts.hosts]
        if drop is not None and drop not in names:
            raise ExokvError(f"/hosts drop {drop}: not a host of this chat ({', '.join(names)})")
        if add is not None and add in names:
            raise ExokvError(f"/hosts add {add}: {add} runs ranks of this chat already")
        moved = replan(self.opts, [drop], dropped=True) if drop else with_host(self.opts, add or "")
        with self._heal_lock:
            self._inner.close()
            try:
                inner = self._start_with(moved.opts)
            except ExokvError as err:
                self._started(self._start_with(self.opts), "the hosts as they were")
                raise ExokvError(f"{moved.what}, but its ranks did not start: {err}") from None
            self.opts = moved.opts
            self._started(inner, moved.said)
        if drop:
            self._left[drop] = "dropped"
        if add:
            self._left.pop(add, None)
        return moved.said

    def _gone(self) -> list[str]:
        """The hosts whose ssh server does not answer now (none without hosts)."""
        if self.opts.hosts is None:
            return []
        return list(unreachable([h.ssh for h in self.opts.hosts.hosts]))

    def _started(self, inner: ClusterClient, why: str) -> None:
        self._inner, self._said = inner, None
        self.ranks = inner.ranks
        self._quiet_watcher()
        self._restarted.append(why)

    def _quiet_watcher(self) -> None:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGUSR1, lambda signum, frame: None)
        inner = self._inner
        threading.Thread(target=self._notice, args=(inner,), daemon=True).start()

    def _notice(self, inner: ClusterClient) -> None:
        """Say at once that the ranks failed while idle (the next request heals it)."""
        while inner is self._inner:
            cause = inner.cause
            if cause is not None:
                with self._lock:
                    busy = self._busy
                if busy:
                    return  # the request in flight heals it
                if not self.heal_when_idle:
                    text = f"{cause.text}; the ranks start again with the next request"
                    self._say_once(cause, text)
                    return
                try:
                    self._heal(cause, inner)
                except ExokvError as err:  # every try failed: the next request says so
                    self._say(str(err))
                return
            time.sleep(0.25)


class ShownOnce:
    """The text of a request that may run again after a restart: the new ranks stream
    its reply from the start, so only what goes past the text already passed on is
    passed on — a reader (the REPL, a server's stream) never gets a piece twice."""

    def __init__(self, on_text: Callable[[str], None] | None) -> None:
        self.on_text = on_text
        self.shown = 0  # characters passed on, over every run
        self.seen = 0  # characters of this run

    def rerun(self) -> None:
        self.seen = 0

    def __call__(self, piece: str) -> None:
        start, self.seen = self.seen, self.seen + len(piece)
        if self.on_text is not None and self.seen > self.shown:
            self.on_text(piece[max(0, self.shown - start) :])
            self.shown = self.seen


def _restart_event(why: str, decision: int, ranks: int) -> CacheEvent:
    return CacheEvent(
        kind="restart", decision=decision, entry=0, tokens=0, bytes=[0] * ranks, reason=why
    )
