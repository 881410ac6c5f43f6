"""The ranks' layout and cache options, parsed: what every layer below the command line gets.

A front end (the chat, the server) checks and parses its flags once, at the boundary
(`exokv.frontend.start.validate`), into a `ClusterOptions`; the client, the cluster and the
disk tier read its values and parse nothing again. The parsers here are the ones that
need nothing but the text: their messages are the ones users see for a bad value.

The ranks get the same record, as the launch settled it, in one `RankOptions` word on
their command line (`exokv.client.cluster` writes it, `exokv.rank.main` reads it, and
`exokv.rank.options` turns it into the engine's options): a new option of the ranks is
a field here and its reading there, with no command line to extend in between.
"""

from __future__ import annotations

import base64
import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Literal

from exokv.core.sizes import parse_size
from exokv.errors import UsageError
from exokv.hosts.hostfile import HostList

AUTO: Literal["auto"] = "auto"  # --disk-budget auto: a share of the free space, per rank
# A rank's disk tier: bytes, AUTO (worked out where the tier lives), or None: no tier.
DiskBudget = int | Literal["auto"] | None


@dataclass(frozen=True)
class KvQuant:
    """--kv-bits and --kv-group-size: how mlx quantizes the KV cache (bits None: it does
    not). They go together wherever the KV is sized, stored or named."""

    bits: int | None = None
    group_size: int = 64


@dataclass(frozen=True)
class ClusterOptions:
    """How to start the ranks and what each keeps, as parsed values."""

    model: str
    ranks: int = 1  # -n as given: ranks on this machine (1 when hosts are named)
    rank_count: int = 1  # the ranks in all: -n, or one per host of --hosts/--hostfile
    hosts: HostList | None = None  # --hosts or --hostfile, read and checked; None: -n
    backend: str = "ring"
    parallel: str = "pipeline"
    split: list[int] | None = None  # layers per rank, rank 0 first; None: auto (a plan's)
    budgets: list[int] | None = None  # cache bytes per rank; None: each rank's default
    memory_threshold: float = 0.9
    max_kv_size: int | None = None
    seed: int | None = None
    no_cache: bool = False
    # The tier each rank gets: None with --no-cache or when a rank's budget is 0.
    disk_budget: DiskBudget = AUTO
    kv: KvQuant = KvQuant()
    starting_port: int | None = None
    restarts: int = 3  # ranks started again after a rank dies, in a row (0: the chat ends)
    # The prompt format every rank renders with (exokv.model.templates): a template spec
    # (a built-in's name or a file's Jinja text; None: the model's own or a fallback),
    # stop sequences besides the template's, and a context limit below the model's.
    chat_template: str | None = None
    stops: tuple[str, ...] = ()
    context: int | None = None
    # --draft-model: a small model with the model's tokenizer that drafts the reply on
    # rank 0 alone (exokv.rank.draft_model); None: drafts from the conversation only.
    draft_model: str | None = None
    # --replicas: copies of each rank's on-disk KV on other hosts (0 or 1); None: 1 over
    # several hosts, 0 on one (exokv.hosts.replicas).
    replicas: int | None = None
    # Hosts outside this launch that may hold KV files of its layers: the hosts a resumed
    # session ran on last (exokv.client.replan.spread_kv copies from them too).
    kv_sources: tuple[str, ...] = ()

    @property
    def keep_cache(self) -> bool:
        """False with --no-cache, and with a budget of 0 on any rank: an entry must fit on
        every rank (each holds its shard of it), so no entry can be kept anywhere."""
        return not self.no_cache and 0 not in (self.budgets or [])

    @property
    def ranks_here(self) -> int:
        """Ranks sharing this machine (and its disk): ranks on several hosts have their own."""
        return 1 if self.hosts is not None else self.ranks


@dataclass(frozen=True)
class RankOptions:
    """What every rank of a chat starts with: the chat's ClusterOptions as the launch
    settled them (the seed drawn, the launcher's backend, the split placed) and what only
    the launch knows. The hosts stay with the front end: a rank needs none of them.

    One command-line word (`to_arg`, base64 JSON: no quoting over ssh or mpirun), the
    same on every rank; the bootstrap line on stdin would reach rank 0 alone, and only
    once the ring is up could rank 0 pass it on, while the backend is needed to form it.
    """

    cluster: ClusterOptions
    ranks_here: int = 1  # ranks sharing this machine's RAM and disk
    front_end_pid: int | None = None  # a local rank ends with the front end
    wake_host: str = "127.0.0.1"  # rank 0's address: the others' doorbell (exokv.wire.wake)
    # For each rank, the rank whose host keeps a copy of its disk tier's files (None:
    # none), as exokv.hosts.replicas decided from the hosts: every rank counts them.
    replica_targets: tuple[int | None, ...] = ()
    # The chat (its front end's own word) and the generation of its plan: each start of
    # the ranks is a new one; a rank of an older one still holding a disk tier is stopped.
    plan_chat: str = ""
    plan_generation: int = 0

    def to_arg(self) -> str:
        """The record as one command-line word."""
        sent = dataclasses.replace(self, cluster=dataclasses.replace(self.cluster, hosts=None))
        return base64.urlsafe_b64encode(json.dumps(dataclasses.asdict(sent)).encode()).decode()

    @classmethod
    def from_arg(cls, arg: str) -> RankOptions:
        """The record `to_arg` wrote (both sides are this version: no other is read)."""
        doc: dict[str, Any] = json.loads(base64.urlsafe_b64decode(arg.encode()))
        cluster = dict(doc.pop("cluster"))
        cluster.update(kv=KvQuant(**cluster["kv"]), stops=tuple(cluster["stops"]))
        cluster["kv_sources"] = tuple(cluster.get("kv_sources", ()))
        doc["replica_targets"] = tuple(doc.get("replica_targets", ()))
        return cls(ClusterOptions(**cluster), **doc)


def parse_budgets(text: str | None, ranks: int) -> list[int] | None:
    """'64MB,16MB' -> one budget per rank; a single value applies to every rank."""
    if text is None:
        return None
    parts = [p for p in text.split(",")]
    if any(not p.strip() for p in parts):
        raise UsageError(f"invalid --cache-budget {text!r}: an empty value between commas")
    sizes = [parse_size(p) for p in parts]
    if len(sizes) == 1:
        return sizes * ranks
    if len(sizes) != ranks:
        raise UsageError(
            f"--cache-budget has {len(sizes)} values for {ranks} ranks: give one, or one per rank"
        )
    return sizes


def parse_split(text: str | None) -> list[int] | None:
    """'3,1' -> [3, 1]: layers per rank, rank 0 first; 'auto' (the default) -> None: placed
    from the hosts' memory (exokv.hosts.plan)."""
    if text is None or text.strip().lower() == AUTO:
        return None
    try:
        split = [int(p) for p in text.split(",")]
    except ValueError:
        raise UsageError(f"invalid --split {text!r}: use auto or whole numbers like 3,1") from None
    if any(s < 1 for s in split):
        raise UsageError(f"invalid --split {text!r}: every rank needs at least one layer")
    return split


def parse_disk_budget(text: str) -> int | Literal["auto"]:
    """'20GB' -> bytes; 'auto' -> AUTO; '0' -> 0 (off)."""
    text = text.strip()
    if text == "0":
        return 0
    if text.lower() == AUTO:
        return AUTO
    try:
        return parse_size(text)
    except UsageError:
        raise UsageError(f"--disk-budget {text!r}: use a size (20GB, 512MB), auto or 0") from None
