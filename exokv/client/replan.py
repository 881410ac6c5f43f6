"""A host that is gone: the ranks placed again on the hosts left, the cache kept.

When the ranks cannot be started again on their hosts (exokv.client.heal), the hosts
that do not answer ssh any more are gone. The layers are placed again on the others
with the rules of `--split auto` (exokv.hosts.plan); a model that does not fit there
is one line saying by how much, and the chat ends with its turns stored. Otherwise
each host left gets the weights of its new layers (exokv.hosts.fetch). Every start on
several hosts (this one, or a stored session resumed on other hosts) first gives each
host the disk tier files of its layers from the hosts that hold them, its own or a
replica (`spread_kv`: exokv.hosts.replicas.kv_moves, copied by exokv.hosts.kvfiles):
the ranks restore the tree every host keeps and read each layer from whichever file
of the node holds it (exokv.cache.disk), so the turn that runs again prefills only
what no host held.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from exokv.cache.tier_options import layout_folder, model_folder_prefix
from exokv.core.options import ClusterOptions
from exokv.core.sizes import format_size
from exokv.errors import ExokvError
from exokv.hosts.fetch import fetch_onto_hosts
from exokv.hosts.hostfile import Host
from exokv.hosts.kvfiles import copy_files, list_pools
from exokv.hosts.placement import DoesNotFit, even_split
from exokv.hosts.plan import place
from exokv.hosts.replicas import kv_moves, layer_ranges
from exokv.launch.command import ssh_names, unreachable


@dataclass
class Replanned:
    """The options the ranks start again with, and what to say about it."""

    opts: ClusterOptions
    said: str  # "exokv-c is gone; the chat goes on on exokv-a, exokv-b (layers 2-3, 0-1)"
    what: str = ""  # what happened alone: "exokv-c is gone", "exokv-d joins"


def replan(opts: ClusterOptions, gone: Sequence[str], dropped: bool = False) -> Replanned:
    """`opts` on the hosts left once `gone` are (their disk tier files move when the
    ranks start: `spread_kv`); `dropped`: left out by `/hosts drop`, not lost. Raises
    ExokvError (one line) when no host is left or the model does not fit."""
    assert opts.hosts is not None
    left = [h for h in opts.hosts.hosts if h.ssh not in gone]
    names = ", ".join(dict.fromkeys(gone))
    verb = "left the plan" if dropped else ("is gone" if len(gone) == 1 else "are gone")
    if not left:
        raise ExokvError(f"{names} {verb}: no host is left to run the model on")
    stored = "" if dropped else "; the session is stored: resume it when the host is back"
    return place_on(opts, left, f"{names} {verb}", stored)


def with_host(opts: ClusterOptions, name: str) -> Replanned:
    """`opts` with host `name` taken on, as the last rank (`/hosts add`)."""
    assert opts.hosts is not None
    return place_on(opts, [*opts.hosts.hosts, Host(name)], f"{name} joins", "")


def place_on(opts: ClusterOptions, hosts: list[Host], what: str, after: str) -> Replanned:
    """`opts` on `hosts`, placed by the rules of --split auto, the weights fetched;
    `what` happened, said with where the layers go (`after` follows a misfit)."""
    assert opts.hosts is not None
    # The launcher gets the hosts in a hostfile of the launch's own (exokv.launch.command).
    listed = dataclasses.replace(opts.hosts, hosts=hosts, hostfile=None)
    # The user's --split and --cache-budget named the old ranks: the plan decides anew.
    moved = dataclasses.replace(opts, hosts=listed, rank_count=len(hosts), split=None, budgets=None)
    where = ", ".join(h.ssh for h in hosts)
    try:
        placed, plan = place(moved)
    except DoesNotFit as err:
        why = str(err).removeprefix("the model does not fit: ")
        raise ExokvError(f"{what} and the model does not fit on {where}: {why}{after}") from None
    fetch_onto_hosts(placed.model, placed.hosts, placed.split, placed.parallel)
    shown = ", ".join(row.layers_text() for row in plan.rows) if plan is not None else ""
    said = f"{what}; the chat goes on on {where}" + (f" (layers {shown})" if shown else "")
    return Replanned(placed, said, what)


def _even_ranges(opts: ClusterOptions, ranks: int) -> list[tuple[int, int]]:
    """The layers of an even split when no plan was made (no sizes to place by)."""
    # deferred: the model's config is read only when no plan gave the layers
    from exokv.model.layer_sizes import SizesUnknown, model_sizes

    try:
        total = len(model_sizes(opts.model, opts.kv).layers)
    except (SizesUnknown, ExokvError, OSError):
        return []
    return layer_ranges(even_split(total, ranks))


def spread_kv(opts: ClusterOptions, say: Callable[[str], None] | None = None) -> Moved:
    """Before ranks start on `opts.hosts`: each host gets the disk tier files of the
    layers its ranks will run from the other hosts that hold them (a replica, or the
    files of an earlier layout), for every pool of the model's tiers found there (any
    may be the lineage a rank's persisted tree names). A pipeline with a disk tier
    only; a host that cannot list or copy keeps what it has (a miss, not a failure)."""
    moved = Moved()
    if opts.hosts is None or opts.parallel != "pipeline" or opts.disk_budget is None:
        return moved
    ranges = layer_ranges(opts.split) if opts.split else _even_ranges(opts, opts.rank_count)
    hosts = ssh_names(opts.hosts.hosts)
    if not ranges:
        return moved
    envs = opts.hosts.envs
    prefix = model_folder_prefix(opts.model)
    layout = layout_folder(opts, "pipeline")
    # The hosts a resumed session ran on last, those that answer: sources, not targets.
    earlier = [h for h in opts.kv_sources if h not in hosts]
    gone = unreachable(earlier, timeout=3.0) if earlier else {}
    distinct = list(dict.fromkeys([*hosts, *(h for h in earlier if h not in gone)]))
    with ThreadPoolExecutor(max_workers=len(distinct)) as pool:
        listed = pool.map(lambda h: list_pools(h, prefix, layout, envs), distinct)
        found = dict(zip(distinct, listed, strict=True))
    wants: dict[str | None, list[tuple[int, int]]] = {}
    for host, layers in zip(hosts, ranges, strict=True):
        wants.setdefault(host, []).append(layers)
    rels = sorted({rel for pools in found.values() for rel in pools})
    for rel in rels:
        held = {host: list(found[host].get(rel, {})) for host in distinct}
        for src, dst, names in kv_moves(held, wants):
            copied = copy_files(src, dst, rel, names, envs, wait=0.0)
            moved.files += copied.files
            moved.bytes += copied.bytes
            moved.seconds += copied.seconds
    if moved.files and say is not None:
        say(
            f"disk cache: {moved.files} files ({format_size(moved.bytes)}) copied to the "
            f"hosts that now run their layers, in {moved.seconds:.1f} s"
        )
    return moved


@dataclass
class Moved:
    """The disk tier files `spread_kv` copied between hosts."""

    files: int = 0
    bytes: int = 0
    seconds: float = 0.0
