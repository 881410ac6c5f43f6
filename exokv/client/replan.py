"""A host that is gone: the ranks placed again on the hosts left, the cache kept.

When the ranks cannot be started again on their hosts (exokv.client.heal), the hosts
that do not answer ssh any more are gone. The layers are placed again on the others
with the rules of `--split auto` (exokv.hosts.plan); a model that does not fit there
is one line saying by how much, and the chat ends with its turns stored. Otherwise
each host left gets the weights of its new layers (exokv.hosts.fetch) and the disk
tier files of its new layers from the hosts that hold them, its own or a replica
(exokv.hosts.replicas.kv_moves, copied by exokv.hosts.kvfiles), before the new ranks
start: they restore the tree every host keeps and read each layer from whichever
file of the node holds it (exokv.cache.disk), so the turn that runs again prefills
only what no host held.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from exokv.core.options import ClusterOptions
from exokv.errors import ExokvError
from exokv.hosts.fetch import fetch_onto_hosts
from exokv.hosts.kvfiles import copy_files, list_files
from exokv.hosts.placement import DoesNotFit, even_split
from exokv.hosts.plan import place
from exokv.hosts.replicas import kv_moves, layer_ranges
from exokv.launch.command import LOOPBACK


@dataclass
class Replanned:
    """The options the ranks start again with, and what to say about it."""

    opts: ClusterOptions
    said: str  # "exokv-c is gone; the chat goes on on exokv-a, exokv-b (layers 2-3, 0-1)"
    moved_bytes: int = 0  # disk tier files copied between the hosts left
    moved_s: float = 0.0


def replan(
    opts: ClusterOptions,
    gone: Sequence[str],
    pool: str,
    say: Callable[[str], None] | None = None,
) -> Replanned:
    """`opts` on the hosts left once `gone` are; `pool` is the disk tier's (under each
    host's kv/, "" without a tier), whose files move to the hosts that now need them.
    Raises ExokvError (one line) when no host is left or the model does not fit."""
    assert opts.hosts is not None
    left = [h for h in opts.hosts.hosts if h.ssh not in gone]
    names = ", ".join(dict.fromkeys(gone))
    if not left:
        raise ExokvError(f"{names}: gone; no host is left to run the model on")
    # The launcher gets the hosts left in a hostfile of the launch's own (exokv.launch.command).
    hosts = dataclasses.replace(opts.hosts, hosts=left, hostfile=None)
    # The user's --split and --cache-budget named the old ranks: the plan decides anew.
    moved = dataclasses.replace(opts, hosts=hosts, rank_count=len(left), split=None, budgets=None)
    where = ", ".join(h.ssh for h in left)
    try:
        placed, plan = place(moved)
    except DoesNotFit as err:
        raise ExokvError(
            f"{names} {'is' if len(gone) == 1 else 'are'} gone and the model does not fit "
            f"on {where}: {str(err).removeprefix('the model does not fit: ')}; the session "
            "is stored: resume it when the host is back"
        ) from None
    fetch_onto_hosts(placed.model, placed.hosts, placed.split, placed.parallel)
    if plan is not None:
        layers = [row.layers for row in plan.rows if row.layers is not None]
        shown = ", ".join(row.layers_text() for row in plan.rows)
    else:
        layers, shown = [], ""
    said = f"{names} {'is' if len(gone) == 1 else 'are'} gone; the chat goes on on {where}"
    said += f" (layers {shown})" if shown else ""
    out = Replanned(placed, said)
    if pool and placed.parallel == "pipeline":
        ranges = list(layers) or _even_ranges(placed, len(left))
        if ranges:
            _move_kv(placed, ranges, pool, out)
    return out


def _even_ranges(opts: ClusterOptions, ranks: int) -> list[tuple[int, int]]:
    """The layers of an even split when no plan was made (no sizes to place by)."""
    # deferred: the model's config is read only when no plan gave the layers
    from exokv.model.layer_sizes import SizesUnknown, model_sizes

    try:
        total = len(model_sizes(opts.model, opts.kv).layers)
    except (SizesUnknown, ExokvError, OSError):
        return []
    return layer_ranges(even_split(total, ranks))


def _move_kv(
    opts: ClusterOptions, ranges: Sequence[tuple[int, int]], pool: str, out: Replanned
) -> None:
    """Each host left gets the files of its new layers from the hosts that hold them."""
    assert opts.hosts is not None
    envs = opts.hosts.envs
    hosts = [None if h.ssh == LOOPBACK else h.ssh for h in opts.hosts.hosts]
    held: dict[str | None, list[str]] = {}
    for host in dict.fromkeys(hosts):
        try:
            held[host] = list(list_files(host, pool, envs))
        except ExokvError:
            held[host] = []  # a host that cannot list its files keeps none of them
    wants: dict[str | None, list[tuple[int, int]]] = {}
    for host, layers in zip(hosts, ranges, strict=True):
        wants.setdefault(host, []).append(layers)
    for src, dst, names in kv_moves(held, wants):
        copied = copy_files(src, dst, pool, names, envs, wait=0.0)
        out.moved_bytes += copied.bytes
        out.moved_s += copied.seconds
