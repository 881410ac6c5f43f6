"""The plain data that crosses boundaries: front end <-> ranks <-> state store.

Everything here is JSON-serialisable (``asdict``/``from_dict``) because it travels
over the rank-0 channel and into SQLite; nothing here touches MLX.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from typing import Any


def _from_dict(cls: type, data: dict[str, Any]) -> Any:
    names = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in data.items() if k in names})


@dataclass
class TurnRequest:
    """One user turn: the whole conversation so far, rendered by every rank alike. An
    assistant message may carry `tokens`, the exact token ids generated for it
    (exokv.prompt.render): the ranks render it as those, and remember nothing."""

    session: str
    messages: list[dict[str, Any]]
    max_tokens: int = 256
    temp: float = 0.0
    seed: int | None = None
    use_cache: bool = True
    top_p: float = 1.0  # nucleus sampling (exokv serve's top_p); 1.0: off
    # Seed the sampler for this turn alone (exokv serve's per-request seed); the chat's
    # --seed seeds the ranks once, so that each /retry samples anew.
    sample_seed: int | None = None
    # Sessions pinned with /pin: their cache entries are evicted after every other's.
    pins: list[str] = field(default_factory=list)
    # Speculative decoding (exokv.rank.speculate): drafts from the turn's own tokens
    # checked by the model; False: one token at a time (--no-speculate).
    speculate: bool = True
    # The reply's grammar (exokv.prompt.grammar's text; None: unconstrained), enforced
    # by every rank's sampler alike (exokv.rank.constrain).
    grammar: str | None = None
    # OpenAI's logprobs: report each token's and this many most likely ones' (0-20;
    # None: none).
    logprobs: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TurnRequest:
        return _from_dict(cls, data)


@dataclass(frozen=True)
class DraftCost:
    """What the ranks know of a draft being typed (typing ahead): its prompt's tokens,
    and how many of them the prefix tree holds already (typed ahead, or cached by
    earlier turns), as of the last draft step."""

    session: str
    tokens: int
    cached: int


@dataclass
class CacheEvent:
    """One change to the cache, identical on every rank by construction.

    kind: add | hit | update | evict | clear, and with a disk tier spill (RAM to disk),
    load (disk to RAM) and drop (off the disk); typing ahead adds draft (a typeahead
    prefill step: `tokens` run) and draft-used (`tokens` of a turn's hit it gave).
    ``bytes`` has one value per rank.
    ``pressures`` is every rank's memory pressure when the decision was taken.
    """

    kind: str
    decision: int
    entry: int
    tokens: int
    bytes: list[int]
    session: str = ""
    reason: str = ""
    pressures: list[float] = field(default_factory=list)
    hit_length: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CacheEvent:
        return _from_dict(cls, data)


@dataclass
class RankStats:
    """One rank's numbers, gathered in the per-turn collective."""

    rank: int
    cache_bytes: int
    entries: int
    budget: int | None
    pressure: float
    ram_total: int
    rss: int
    mlx_active: int
    disk_bytes: int = 0  # in the disk tier (exokv.cache.disk_tier); 0 without one
    disk_budget: int | None = None
    # Of disk_bytes, the copies of other ranks' files this rank's host keeps (--replicas).
    replica_bytes: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RankStats:
        return _from_dict(cls, data)


@dataclass
class HostState:
    """One host of a chat over several machines, as `/hosts` lists it."""

    host: str
    state: str  # "up"; "gone" (its ssh server stopped answering); "dropped" (/hosts drop)
    ranks: list[int] = field(default_factory=list)  # its ranks now (none once gone)
    layers: str = ""  # the layers they run, as the plan shows them ("0-10", "11-21")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class EntryInfo:
    """One live node of the prefix tree (an 'entry'), with its bytes on each rank."""

    id: int
    parent: int | None
    session: str
    tokens: int
    depth: int
    bytes: list[int]
    hits: int
    last_used: int
    tier: str = "ram"  # or "disk"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EntryInfo:
        return _from_dict(cls, data)


@dataclass
class TurnResult:
    """What one turn did: the reply, the token counts, the timings and the cache's changes."""

    session: str
    reply: str
    prompt_tokens: int
    cached_tokens: int
    prefilled_tokens: int
    generated_tokens: int
    ttft_s: float
    decode_tps: float
    overhead_s: float
    ranks: int
    finish_reason: str = "stop"
    decision: int = 0
    events: list[CacheEvent] = field(default_factory=list)
    rank_stats: list[RankStats] = field(default_factory=list)
    entries: list[EntryInfo] = field(default_factory=list)
    typed_ahead_tokens: int = 0  # of cached_tokens, those prefilled while the user typed
    draft_tokens: int = 0  # speculative decoding: draft tokens the model checked
    accepted_tokens: int = 0  # of those, the reply's (each saved a forward pass)
    model_draft_tokens: int = 0  # of draft_tokens, those --draft-model proposed
    speculation: str = ""  # why the turn decoded without drafts ("off", or its cache's kind)
    # Why a drafting turn drafted what it did (exokv.rank.draft.Drafter.detail, rank 0's):
    # its steps, the reasons of its draft decisions, the acceptance and the pass cost.
    speculation_detail: dict[str, Any] = field(default_factory=dict)
    # The reply's exact token ids (no end of turn): what its message carries from now on
    # (exokv.prompt.render). Not shown: the front ends' JSON names the fields it shows.
    reply_tokens: list[int] = field(default_factory=list)
    # The nodes whose disk tier files the turn wrote: the front end copies each rank's to
    # the host that keeps its replica (exokv.client.replicate). Not shown.
    disk_written: list[int] = field(default_factory=list)
    # With a request's `logprobs`: per generated token [text, logprob, [[text, logprob],
    # ...]] (exokv.rank.constrain.entry); None without.
    logprobs: list[Any] | None = None
    # The replica copies that ended since the turn before (the last turn's, as a rule):
    # their bytes and seconds, and why one failed ("" when none did).
    replica_bytes: int = 0
    replica_s: float = 0.0
    replica_error: str = ""

    @property
    def evictions(self) -> int:
        return sum(1 for e in self.events if e.kind == "evict")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TurnResult:
        result = _from_dict(cls, data)
        result.events = [CacheEvent.from_dict(e) for e in data.get("events", [])]
        result.rank_stats = [RankStats.from_dict(r) for r in data.get("rank_stats", [])]
        result.entries = [EntryInfo.from_dict(e) for e in data.get("entries", [])]
        return result


@dataclass
class RowOutcome:
    """One request's end in a batch of turns (`Client.turns`): its result, or the
    refusal (a prompt over the context) that kept it from running."""

    result: TurnResult | None = None
    refused: str | None = None  # why, in one line
    tokens: int = 0  # the refused prompt's tokens
    context: int = 0  # and the model's context
    batch: int = 1  # rows decoded together with it (1: it ran alone)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RowOutcome:
        outcome = _from_dict(cls, data)
        result = data.get("result")
        outcome.result = TurnResult.from_dict(result) if result is not None else None
        return outcome


@dataclass(frozen=True)
class BatchCalls:
    """What the caller of a batch of turns (`Client.turns`) hears, row by row: each
    row's text as it streams, whether a row should stop (asked at every decode step),
    each row's outcome as soon as it ends, and the requests that join the batch in
    flight. Every client a batch passes through hands these on as one."""

    on_text: Callable[[int, str], None] | None = None
    should_stop: Callable[[int], bool] | None = None
    on_row: Callable[[int, RowOutcome], None] | None = None
    joins: Callable[[], list[TurnRequest]] | None = None


NO_CALLS = BatchCalls()


TIER_OFF_BECAUSE = "the disk tier is off: "  # a report's `skipped` when a rank said why


@dataclass
class CacheFileReport:
    """What one /save or resume did on the disk tier (exokv.rank.kvsave); ``bytes`` and
    ``paths`` are per rank."""

    session: str
    tokens: int = 0  # tokens of the conversation on disk (saved, or found at resume)
    bytes: list[int] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)  # each rank's disk tier directory
    seconds: float = 0.0
    warning: str | None = None  # a problem: the cache was not (fully) saved
    skipped: str | None = None  # nothing to do, not a problem (no tier, nothing cached)
    events: list[dict[str, Any]] = field(default_factory=list)  # CacheEvent dicts (drops)
    on_disk: bool = False  # at resume: all of `tokens` is on disk (else some is in RAM)
    disk_bytes: list[int] = field(default_factory=list)  # each rank's whole tier, after

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CacheFileReport:
        return _from_dict(cls, data)
