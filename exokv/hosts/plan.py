"""The ranks' layout decided before they start: each host's memory gathered, the model's
layer sizes read from its headers, a plan made (exokv.hosts.placement) and shown.

Both front ends (the chat and `exokv serve`) call `place` between parsing their
options and starting the ranks, so the split the ClusterOptions hold from then on is
the one every later step (fetching each host's files, launching) uses.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from typing import IO, Any

from exokv.config import TEST_HOOKS
from exokv.core.options import ClusterOptions
from exokv.core.sizes import format_size
from exokv.errors import ExokvError
from exokv.hosts.placement import DoesNotFit, Plan, RankRoom, place_tensor, plan_split
from exokv.hosts.placement import place as place_layers
from exokv.model.hub import repo_of
from exokv.model.layer_sizes import SizesUnknown, model_sizes


class HostsUnknown(ExokvError):
    """A host gave no memory figures (unreachable, or no exokv.hosts.probe there)."""


def place(cluster: ClusterOptions, show: bool = False) -> tuple[ClusterOptions, Plan | None]:
    """`cluster` with the planned split and budgets (each unless given), and the plan.

    More than one rank, or `show` (--plan), makes a plan; otherwise nothing changes.
    `--split auto` (the default) places the layers and refuses a model that does not
    fit; a split given is kept as given (a warning if it does not fit); with
    `--parallel tensor` there is no split to choose, so the plan checks the memory
    and sets the budgets. When the layers' sizes or a host's memory cannot be had,
    auto falls back to mlx-lm's even split with one line saying why (no line for a
    local model unreadable where every rank loads it: the ranks' refusal says it).
    """
    if cluster.rank_count == 1 and not show:
        return cluster, None
    try:
        rooms = rank_rooms(cluster)
        # A model that is not there at all fails here, in its own one line.
        sizes = model_sizes(cluster.model, cluster.kv)
    except (HostsUnknown, SizesUnknown) as err:
        if show:
            raise
        local = cluster.hosts is None and repo_of(cluster.model) is None
        if isinstance(err, SizesUnknown) and local:
            # A local model whose files cannot be read here, where every rank loads it:
            # the ranks refuse it in their own one line (naming the file), which a
            # second line here would only precede. (On other hosts it may be whole.)
            return cluster, None
        _say(f"no plan from memory: {err}; the layers are shared out evenly")
        return cluster, None
    if cluster.parallel == "tensor" and cluster.rank_count > 1:
        plan = place_tensor(rooms, sizes, cluster.memory_threshold)
    elif cluster.split is not None or cluster.rank_count == 1:
        split = cluster.split or [len(sizes.layers)]
        plan = plan_split(rooms, sizes, split, cluster.memory_threshold)
        if cluster.split is None:
            plan = replace(plan, source="auto")
    else:
        plan = place_layers(rooms, sizes, cluster.memory_threshold)
    if cluster.budgets is not None:
        plan = plan.with_budgets(cluster.budgets)
    problems = plan.short()
    if problems and plan.source == "given" and not show:
        _say(f"warning: --split {_split_text(plan)} may not fit: {'; '.join(problems)}")
    if cluster.rank_count == 1:
        return cluster, plan
    # A given split that leaves a rank no room gets the ranks' own budgets, not a 0 that
    # would turn the cache off everywhere.
    given_split_fits = plan.source == "auto" or not (problems or 0 in plan.budgets)
    return (
        replace(
            cluster,
            # (a --split with tensor parallelism stays, for the launcher to refuse)
            split=plan.split if cluster.parallel == "pipeline" else cluster.split,
            budgets=cluster.budgets or (plan.budgets if given_split_fits else None),
        ),
        plan,
    )


def rank_rooms(cluster: ClusterOptions) -> list[RankRoom]:
    """Each rank's host, its usable memory and the ranks sharing it, in rank order."""
    # deferred: hosts.facts brings the probe (psutil, importlib.metadata: ~30 ms); every
    # chat imports this module, and only a plan (several ranks, or --plan) asks the hosts
    from exokv.hosts.facts import ask_hosts

    hosts: list[str | None] = (
        [h.ssh for h in cluster.hosts.hosts] if cluster.hosts is not None else [None]
    )
    distinct = list(dict.fromkeys(hosts))
    answers = dict(zip(distinct, ask_hosts(distinct), strict=True))
    facts: dict[str | None, Any] = {}
    for host, answer in answers.items():
        if not answer.reached:  # no chat can start there: say so now, not after a fallback
            rank = hosts.index(host)
            raise ExokvError(f"rank {rank}'s host {host!r} cannot be reached: {answer.error}")
        if answer.facts is None:
            raise HostsUnknown(f"{host or 'this machine'} gave no memory figures: {answer.error}")
        facts[host] = answer.facts
    per_rank = hosts if cluster.hosts is not None else [None] * cluster.rank_count
    rooms = []
    for host in per_rank:
        fact = facts[host]
        assert not isinstance(fact, str)
        usable = fact.memory_available
        if fact.working_set is not None:  # Metal keeps no more than this resident
            usable = min(usable, fact.working_set)
        rooms.append(RankRoom(host or fact.hostname, usable, per_rank.count(host)))
    simulated = TEST_HOOKS.host_memory([r.host for r in rooms])
    if simulated is not None:  # tests: each rank a host of its own, with this memory
        rooms = [RankRoom(r.host, m, 1) for r, m in zip(rooms, simulated, strict=True)]
    return rooms


def plan_table(plan: Plan, width: int) -> Any:
    """The plan as a table: host, layers, weights, cache budget, free after."""
    # deferred: core.tables brings rich (~0.1 s); every chat imports this module, few show a plan
    from exokv.core.tables import Column, fit

    columns = [
        Column("rank"),
        Column("host", justify="left"),
        Column("memory", priority=1),
        Column("layers"),
        Column("weights"),
        Column("cache budget"),
        Column("free after"),
    ]
    rows = [
        [
            str(row.rank),
            row.host,
            format_size(row.memory),
            row.layers_text(),
            format_size(row.weights),
            format_size(row.budget),
            format_size(row.free_after),
        ]
        for row in plan.rows
    ]
    return fit(columns, rows, width)


def plan_caption(plan: Plan) -> str:
    """What the table does not say, a clause a line: each fits 80 columns."""
    how = {"auto": "placed from memory", "given": "as given"}[plan.source]
    layout = f"split {_split_text(plan)} ({how})" if plan.split else "tensor parallel"
    budgets = (
        "--cache-budget" if plan.budgets_given else f"{plan.threshold:g} of memory, less weights"
    )
    return (
        f"{layout}; cache budgets: {budgets};\nthe cache holds about "
        f"{plan.cache_tokens:,} tokens before its tightest rank is full"
    )


def show_plan(plan: Plan, file: IO[str] | None = None) -> None:
    """The table and its caption, on stderr unless `file` says otherwise."""
    # deferred: rich (~0.1 s) only to show a plan; every chat imports this module
    from rich.console import Console

    console = Console(file=file or sys.stderr, highlight=False, soft_wrap=True)
    console.print(plan_table(plan, console.width))
    console.print(plan_caption(plan), soft_wrap=False)  # narrower than 80: at spaces


def print_plan(plan: Plan | None, as_json: bool) -> int:
    """`--plan`: the placement on stdout (one JSON document with --json), exit 0."""
    assert plan is not None
    if as_json:
        print(json.dumps(plan.to_dict(), indent=2))
    else:
        show_plan(plan, sys.stdout)
    return 0


def plan_event(plan: Plan) -> dict[str, Any]:
    """The plan as the first turn's `plan` event in --json."""
    return {"kind": "plan", **plan.to_dict()}


def _split_text(plan: Plan) -> str:
    return ",".join(map(str, plan.split or []))


def _say(text: str) -> None:
    print(f"exokv: {text}", file=sys.stderr, flush=True)


__all__ = ["DoesNotFit", "place", "plan_event", "print_plan", "rank_rooms", "show_plan"]
