"""Where each rank's KV is kept a second time: the replica rules, pure.

With `--replicas 1` every rank's on-disk KV has a copy on one other host, so a chat
survives the loss of any one Mac with its whole cache (docs/cluster.md, "When a Mac
leaves"). The copy goes to the next rank in the ring (rank r+1, r+2, ... wrapping
round) whose host is another machine; ranks sharing one host keep no replicas of each
other (the same disk would hold both). Every rank computes the same answer from the
hosts in rank order, so each can count the replica bytes it holds for others against
its disk budget with no more communication than the turn's one gather.
"""

from __future__ import annotations

from collections.abc import Sequence

from exokv.hosts.placement import local_range


def replica_targets(hosts: Sequence[str | None], replicas: int) -> list[int | None]:
    """For each rank, the rank whose host keeps a copy of its KV (None: no copy).

    `hosts` names each rank's machine in rank order (None: this machine)."""
    n = len(hosts)
    if replicas <= 0 or len(set(hosts)) < 2:
        return [None] * n
    out: list[int | None] = []
    for r in range(n):
        target = next((t % n for t in range(r + 1, r + n) if hosts[t % n] != hosts[r]), None)
        out.append(target)
    return out


def held_for(targets: Sequence[int | None], rank: int) -> list[int]:
    """The ranks whose KV `rank`'s host keeps a copy of, counted against `rank`'s disk."""
    return [s for s, t in enumerate(targets) if t == rank]


def default_replicas(hosts: Sequence[str | None]) -> int:
    """`--replicas` when not given: 1 over several machines, 0 on one."""
    return 1 if len(set(hosts)) > 1 else 0


def layer_ranges(split: Sequence[int], pipelined: bool = True) -> list[tuple[int, int]]:
    """Each rank's [start, end) layers: for a pipeline `split` (layers per rank, rank 0
    runs the last ones, as exokv.hosts.placement.local_range has it), or every layer on
    every rank (tensor parallelism: `split` is then each rank's count, all the same)."""
    if not pipelined:
        return [(0, n) for n in split]
    return [local_range(split, rank) for rank in range(len(split))]


def file_name(node_id: int, layers: tuple[int, int]) -> str:
    """A node's file for layers [a, b): the same name on every host that keeps it."""
    return f"{node_id}.L{layers[0]}-{layers[1]}.kv"


def parse_file_name(name: str) -> tuple[int, tuple[int, int]] | None:
    """(node id, (a, b)) of a KV file's name, or None for any other name."""
    stem, dot, ext = name.rpartition(".")
    node, _, span = stem.partition(".L")
    start, _, end = span.partition("-")
    if not (dot and ext == "kv" and node.isdigit() and start.isdigit() and end.isdigit()):
        return None
    a, b = int(start), int(end)
    return (int(node), (a, b)) if a < b else None


Layers = tuple[int, int]


def kv_moves(
    held: dict[str | None, list[str]], wants: dict[str | None, list[Layers]]
) -> list[tuple[str | None, str | None, list[str]]]:
    """The copies that give each host the files of the layers its ranks run after a
    re-plan: (from, to, file names), from `held` (each host's files, by name) and
    `wants` (each host's ranks' layers). A host takes each missing layer of a node from
    the first other host that has a file holding it; layers it holds already stay."""
    by_host: dict[str | None, dict[int, list[Layers]]] = {}
    for host, names in held.items():
        nodes = by_host.setdefault(host, {})
        for name in names:
            parsed = parse_file_name(name)
            if parsed is not None:
                nodes.setdefault(parsed[0], []).append(parsed[1])
    every = sorted({n for nodes in by_host.values() for n in nodes})
    moves: dict[tuple[str | None, str | None], list[str]] = {}
    for dst, ranges in wants.items():
        mine = by_host.get(dst, {})
        for node in every:
            have = {layer for a, b in mine.get(node, []) for layer in range(a, b)}
            missing = {layer for a, b in ranges for layer in range(a, b)} - have
            for src, nodes in by_host.items():
                if src == dst:
                    continue
                for a, b in nodes.get(node, []):
                    if missing & set(range(a, b)):
                        moves.setdefault((src, dst), []).append(file_name(node, (a, b)))
                        missing -= set(range(a, b))
    return [(src, dst, names) for (src, dst), names in moves.items()]
