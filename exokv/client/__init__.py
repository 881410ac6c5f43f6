"""The front end's one way to run turns: a `Client`, whatever runs them.

`local.LocalClient` runs the engine in this process (one rank); `cluster.ClusterClient`
starts ranks with mlx.launch and speaks to rank 0 over the channel. The REPL, script
mode and one-shot prompts (through `ChatController`) and any other front end hold a
`Client` from `make_client` and never need to know which one it is.

A client remembers nothing about replies: each reply's exact tokens travel with its
message (a request's assistant messages carry `tokens`; a result carries the reply's,
`TurnResult.reply_tokens`), so ranks started again need nothing given back. Nor does
it time the turn: the front end does, from Enter (exokv.client.stopwatch).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from exokv.core.options import ClusterOptions, RankOptions
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


class Client(Protocol):
    """Runs turns on one rank or on a cluster."""

    ranks: int
    # Why the ranks are gone for good, once they are: the chat cannot go on (a front end
    # ends then). None while they run, and always for a client that heals its ranks or
    # runs the model in this process.
    failure: str | None

    def turn(
        self,
        request: TurnRequest,
        on_text: Callable[[str], None] | None = None,
        on_progress: Callable[[int, int], None] | None = None,
    ) -> TurnResult: ...

    def stop(self) -> None:
        """Ask the reply being generated to end at the next token (Ctrl-C)."""
        ...

    def draft(
        self, session: str, messages: list[dict[str, str]], text: str, wait: bool = False
    ) -> None:
        """Prefill ahead of Enter (exokv.rank.typeahead): the conversation `messages` with
        the user's unsent `text`, in steps the next draft or turn interrupts; "" abandons
        it. Returns at once (`wait`: once the ranks have done all of it or given it up)."""
        ...

    def draft_cost(self, session: str) -> DraftCost | None:
        """What the last draft step of `session` left: the draft's prompt tokens and how
        many the tree holds (None: no step yet). Never waits: the REPL's toolbar asks."""
        ...

    def turns(
        self,
        requests: list[TurnRequest],
        calls: BatchCalls = NO_CALLS,
    ) -> list[RowOutcome]:
        """Several requests' turns decoded together (exokv.rank.batch), outcomes in order;
        on_text(row, piece) streams each row, should_stop(row) ends one row (agreed by
        every rank within a decode step), on_row(row, outcome) as soon as a row ends.
        joins() (if given) is asked while the batch runs for requests that join it at
        a decode step; their rows are numbered after the rows before them."""
        ...

    def nudge(self) -> None:
        """A request may join the batch in flight: ask `joins` soon (a cluster's reader
        waits on the ranks' messages; one rank asks at every step anyway)."""

    def stop_now(self) -> None:
        """As `stop`, sent from the calling thread before it returns (not a signal handler)."""
        ...

    def release_thread(self) -> None:
        """The calling thread, which ran turns, is about to end (a server's worker): free
        what the model keeps for it here (one rank only; ranks elsewhere keep their own)."""
        ...

    def stop_row(self, row: int) -> None:
        """End row `row` of the batch in flight at its next decode step (any thread may
        ask, the moment it learns the row's client left); should_stop(row) must say so too."""
        ...

    @property
    def budgets(self) -> list[int | None]:
        """Each rank's cache budget in bytes (None: no budget)."""
        ...

    @property
    def kv_per_token(self) -> list[int]:
        """Each rank's bytes of K/V per token of a row (a server sizes its batch by it)."""
        ...

    @property
    def model_context(self) -> int | None:
        """The model's context in tokens, as the ranks apply it (None: unknown)."""
        ...

    def save_cache(self, session: str, messages: list[dict[str, str]]) -> CacheFileReport:
        """Write the conversation's cached path to the disk tier (of every rank)."""
        ...

    def cache_held(self, session: str, messages: list[dict[str, str]]) -> CacheFileReport:
        """How much of a resumed conversation the cache holds."""
        ...

    def health(self) -> str | None:
        """Why the ranks cannot take a request now (down, starting again), in words;
        None when they can (a server's /health says it)."""
        ...

    def hosts(self) -> list[HostState]:
        """The hosts of a chat over several machines, with their state and layers ([]
        on one machine)."""
        ...

    def change_hosts(self, add: str | None = None, drop: str | None = None) -> str:
        """Place the layers again with host `add` taken on or `drop` left out, and start
        the ranks there (between turns: the REPL's `/hosts add|drop`); what happened, in
        one line. ExokvError (one line) when it cannot, the ranks as they were."""
        ...

    def close(self) -> None: ...


def make_client(
    opts: ClusterOptions,
    progress: Callable[[str], None] | None = None,
    in_process: bool = True,
) -> Client:
    """The client `opts` asks for: the engine in this process for one local rank where
    `in_process` allows it, else ranks started by mlx.launch. `progress` hears the
    ranks' start-up, one line at a time."""
    # One rank runs here unless a hostfile names its machine (a --hosts of one name
    # runs here too, as it always has), or the front end keeps its own process for
    # other work (a server's event loop: see exokv.frontend.start.started).
    no_hostfile = opts.hosts is None or opts.hosts.hostfile is None
    if in_process and opts.rank_count == 1 and no_hostfile:
        # The engine's modules import mlx-lm (seconds): only a chat that runs it here does.
        from exokv.client.local import LocalClient
        from exokv.rank.options import engine_options

        return LocalClient(
            opts.model,
            draft_model=opts.draft_model,
            options=engine_options(RankOptions(opts), rank=0, layout="pipeline:1:even"),
        )
    # Here, not at the top: these modules import `Client` from this one.
    from exokv.client.cluster import ClusterClient
    from exokv.client.heal import HealingClient

    if opts.draft_model is not None:  # before the ranks start: rank 0 loads it
        # It imports mlx-lm (seconds): only with --draft-model.
        from exokv.rank.draft_model import check_names

        check_names(opts.model, opts.draft_model)

    def start(settled: ClusterOptions) -> ClusterClient:
        return ClusterClient(settled, progress=progress)

    return HealingClient(start, opts) if opts.restarts > 0 else start(opts)
