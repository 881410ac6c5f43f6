"""The start both front ends share (`exokv chat` and `exokv serve`): the options checked
and placed, the store opened, the session locked, the weights fetched onto the hosts and
the ranks started; undone in reverse when the front end ends."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import psutil

from exokv.cache.tier_options import check_kv_quantization
from exokv.client import Client, make_client
from exokv.core.options import (
    AUTO,
    ClusterOptions,
    KvQuant,
    parse_budgets,
    parse_disk_budget,
    parse_split,
)
from exokv.errors import UsageError
from exokv.frontend.hooks import StoreHooks
from exokv.hosts.fetch import fetch_onto_hosts
from exokv.hosts.hostfile import HostList, parse_hosts, read_hostfile
from exokv.hosts.placement import Plan
from exokv.hosts.plan import place, show_plan
from exokv.model.templates import Format
from exokv.state import Store, register_chat
from exokv.state.locks import SessionLocks


@dataclass
class ChatOptions:
    """The chat's flags as the command line gives them; `validate` parses the ranks'
    layout and cache among them into the ClusterOptions every layer below receives.
    `exokv serve` starts from one too (exokv.serve.run.ServeOptions), with the chat's
    own flags (--session, --json, --plain, ...) left at their defaults."""

    model: str
    system: str | None = None
    max_tokens: int = 256
    temp: float = 0.0
    seed: int | None = None
    ranks: int = 1
    hosts: str | None = None
    hostfile: str | None = None
    backend: str = "ring"
    parallel: str = "pipeline"
    split: str | None = None
    cache_budget: str | None = None
    memory_threshold: float = 0.9
    max_kv_size: int | None = None
    no_cache: bool = False
    no_typeahead: bool = False  # the REPL sends no draft to the ranks (exokv.chat.typeahead)
    no_speculate: bool = False  # decode one token at a time (exokv.rank.speculate)
    draft_model: str | None = None  # a small model drafting on rank 0 (exokv.rank.draft_model)
    disk_budget: str | None = None  # the disk tier (exokv.cache.tier_options): 20GB, auto or 0
    kv_bits: int | None = None
    kv_group_size: int = 64
    session: str | None = None
    json: bool = False
    plain: bool = False  # the REPL prints replies as raw text, not rendered markdown
    starting_port: int | None = None
    restarts: int = 3  # ranks started again after a rank dies, in a row (0: the chat ends)
    replicas: int | None = None  # copies of each rank's disk tier elsewhere; None: by hosts
    prompt: str | None = None  # `exokv chat PROMPT`: one turn, then exit
    plan: bool = False  # --plan: print where the layers and the cache go, then exit
    chat_template: str | None = None  # --chat-template as a spec (what the session keeps)
    # What the ranks render with: the template above or the model's default (an ollama
    # manifest's), and its stop sequences and context limit (exokv.frontend.resume).
    prompt_format: Format = field(default_factory=Format)

    def host_list(self) -> HostList | None:
        """--hosts or --hostfile, read and checked (one line for a bad one); None: -n."""
        if (self.hosts or self.hostfile) and self.ranks > 1:
            raise UsageError("use -n for ranks on this machine, or --hosts/--hostfile, not both")
        if self.hosts and self.hostfile:
            raise UsageError("use --hosts or --hostfile, not both")
        if self.hostfile:
            return read_hostfile(self.hostfile)
        return parse_hosts(self.hosts) if self.hosts else None


# The largest integer SQLite stores (budgets and sizes end up in the database).
SQLITE_MAX_INT = 2**63 - 1
SEED_RANGE = 2**64  # mx.random.seed takes an unsigned 64-bit number
# Less than this much free memory per rank and the ranks cannot all start (python,
# mlx and a shard of the model each): refuse before launching rather than thrash.
RANK_MEMORY_FLOOR = 256 * 1024 * 1024


def validate(opts: ChatOptions) -> ClusterOptions:
    """Every option's bounds, before anything is started: one line and exit 2 each; the
    ranks' layout and cache options parsed, once."""
    _check_bounds(opts)
    hosts = opts.host_list()
    ranks = opts.ranks if hosts is None else len(hosts.hosts)
    budgets = parse_budgets(opts.cache_budget, ranks)
    if any(b > SQLITE_MAX_INT for b in budgets or []):
        raise UsageError(f"--cache-budget {opts.cache_budget}: larger than {SQLITE_MAX_INT} bytes")
    split = parse_split(opts.split)
    if split is not None and ranks == 1:
        raise UsageError("--split spreads layers over ranks: it needs -n 2 or more, or --hosts")
    if hosts is None and opts.ranks > 1:
        _check_room(opts.ranks)
    given = None if opts.disk_budget is None else parse_disk_budget(opts.disk_budget)
    kv = KvQuant(opts.kv_bits, opts.kv_group_size)
    check_kv_quantization(kv)
    # A rank that keeps nothing has nothing to spill either: no tier anywhere.
    keeps_nothing = opts.no_cache or 0 in (budgets or [])
    return ClusterOptions(
        model=opts.model,
        ranks=opts.ranks,
        rank_count=ranks,
        hosts=hosts,
        backend=opts.backend,
        parallel=opts.parallel,
        split=split,
        budgets=budgets,
        memory_threshold=opts.memory_threshold,
        max_kv_size=opts.max_kv_size,
        seed=opts.seed,
        no_cache=opts.no_cache,
        disk_budget=None if keeps_nothing else (given if opts.disk_budget else AUTO),
        kv=kv,
        starting_port=opts.starting_port,
        restarts=opts.restarts,
        replicas=opts.replicas,
        chat_template=opts.prompt_format.template or opts.chat_template,
        stops=opts.prompt_format.stops,
        context=opts.prompt_format.context,
        draft_model=opts.draft_model.strip() if opts.draft_model else None,
    )


def _check_bounds(opts: ChatOptions) -> None:
    """The bounds of the options read as numbers and names, each on its own."""
    if not 1 <= opts.max_tokens <= SQLITE_MAX_INT:
        raise UsageError(f"--max-tokens must be between 1 and {SQLITE_MAX_INT}")
    if not math.isfinite(opts.temp) or opts.temp < 0:
        raise UsageError(f"--temp {opts.temp}: must be a number, 0 or more")
    if opts.seed is not None and not 0 <= opts.seed < SEED_RANGE:
        raise UsageError(f"--seed {opts.seed}: must be between 0 and 2**64-1")
    if not 0 < opts.memory_threshold <= 1:
        raise UsageError("--memory-threshold must be a fraction in (0, 1]")
    if opts.ranks < 1:
        raise UsageError("--ranks must be at least 1")
    if opts.max_kv_size is not None and not 1 <= opts.max_kv_size <= SQLITE_MAX_INT:
        raise UsageError(f"--max-kv-size must be between 1 and {SQLITE_MAX_INT}")
    if opts.draft_model is not None and not opts.draft_model.strip():
        raise UsageError("--draft-model is empty: give a model name, as --model takes")
    if opts.draft_model is not None and opts.no_speculate:
        raise UsageError("--draft-model drafts for speculative decoding: not with --no-speculate")


def _check_room(ranks: int) -> None:
    """-n `ranks` on this machine: refused when its free memory cannot hold them."""
    room = psutil.virtual_memory().available // RANK_MEMORY_FLOOR
    if ranks > room:
        raise UsageError(
            f"-n {ranks}: this machine has memory to start about {room} ranks "
            f"({RANK_MEMORY_FLOOR // 2**20} MB each at least)"
        )


def _startup_progress():  # noqa: ANN202 - a line printer, or None
    """Ranks take seconds to start: on a terminal, say what happens (on stderr)."""
    if not sys.stderr.isatty():
        return None

    def say(text: str) -> None:
        print(f"exokv: {text}", file=sys.stderr, flush=True)

    return say


def prepare(opts: ChatOptions) -> tuple[ClusterOptions, Plan | None]:
    """The options checked, then the layout placed from the hosts' memory (and shown on
    a terminal), before anything starts: the ClusterOptions the ranks are launched
    with, and the plan (None on one rank)."""
    cluster, plan = place(validate(opts), show=opts.plan)
    # On a terminal, as the start-up lines: script mode's stderr keeps to one line a
    # problem (--json has the plan as the first turn's `plan` event).
    if plan is not None and not opts.plan and sys.stderr.isatty():
        show_plan(plan)
    return cluster, plan


@dataclass
class Started:
    """What a front end drives: the store, the session locks, the client and its run."""

    store: Any
    locks: Any
    client: Client  # LocalClient or ClusterClient
    run_id: int
    cluster: ClusterOptions  # what the client was started with


@contextlib.contextmanager
def started(opts: ChatOptions, cluster: ClusterOptions, kind: str = "chat") -> Iterator[Started]:
    """Open the store, start the ranks, record the run and mark it running; undo all on exit.

    The wiring both front ends (the chat and `exokv serve`) share: the ranks shut down
    like /quit when the block ends (their disk tier keeps the cache), whatever ended it.
    """
    store = Store.open()  # before loading the model: a bad database fails fast
    locks = SessionLocks(store.home)
    try:
        if opts.session:
            locks.acquire(opts.session)  # a session open elsewhere fails before the ranks start
            cluster = with_earlier_hosts(cluster, store.last_hosts(opts.session))
        fetch_onto_hosts(
            cluster.model, cluster.hosts, cluster.split, cluster.parallel, draft=cluster.draft_model
        )
        # A server's one rank runs in a process of its own, as two ranks do: in the
        # server's process, the engine's Python and the event loop writing every
        # stream's chunks share one interpreter lock and, on a busy machine, fewer
        # cores (docs/serve.md, "One rank in a process of its own"). A chat has no such
        # second job, and starts faster with its engine here.
        in_process = kind != "serve"
        client = make_client(cluster, progress=_startup_progress(), in_process=in_process)
        run_id: int | None = None
        try:
            hosts = [h.ssh for h in cluster.hosts.hosts] if cluster.hosts else []
            run_id = store.start_run(opts.model, client.ranks, list(client.budgets), hosts)
            with register_chat(
                store.home,
                model=opts.model,
                ranks=client.ranks,
                run=run_id,
                session=opts.session,
                kind=kind,
            ):
                yield Started(store, locks, client, run_id, cluster)
        finally:
            try:
                if run_id is not None:
                    store.end_run(run_id)
            finally:
                client.close()
    finally:
        locks.release_all()
        store.close()


def with_earlier_hosts(cluster: ClusterOptions, earlier: list[str]) -> ClusterOptions:
    """A session resumed on other hosts: those it ran on last may hold the KV files of
    the layers this launch's hosts will run (exokv.client.replan.spread_kv)."""
    if cluster.hosts is None:
        return cluster
    now = {h.ssh for h in cluster.hosts.hosts}
    sources = tuple(h for h in earlier if h not in now)
    return dataclasses.replace(cluster, kv_sources=sources) if sources else cluster


def store_hooks(run: Started, opts: ChatOptions, locks: bool = True) -> Any:
    """The store's hooks for this run's turns (StoreHooks); `locks`: one chat per session."""
    return StoreHooks(
        run.store,
        run.run_id,
        opts.model,
        client=run.client,
        use_cache=run.cluster.keep_cache,
        max_kv_size=opts.max_kv_size,
        chat_template=opts.chat_template,
        locks=run.locks if locks else None,
    )
