"""Every message between the front end and rank 0 (and from rank 0 to the other ranks).

One dataclass per message; its `TYPE` is the `"type"` it has on the wire. `encode`
gives the JSON object the channel sends (exokv.wire.channel) and the per-step
broadcast carries (exokv.rank.main.in_step); `decode` gives the message back, or
raises `MessageError` for an object that is not one of these (an unknown type, a
field missing or of the wrong kind). Nothing else builds or reads a message's dict.

A new message: a class here with its `TYPE`, added to `_CLASSES`; then the side that
receives it handles it (the rank: a handler in `Rank`'s table; the front end: the
`ClusterClient` loop that waits for it).
"""

from __future__ import annotations

import re
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any, ClassVar

from exokv.core.records import CacheFileReport, RowOutcome, TurnRequest, TurnResult
from exokv.errors import ExokvError

RequestId = int | str | None  # a request's number (turns, batch rows), "draft-N" for drafts


class MessageError(ExokvError):
    """An object that is not a message this module knows."""


# The Python types a field's annotation allows, by the annotation's names (records
# arrive as dicts, decoded by their own from_dict).
_KINDS: dict[str, tuple[type, ...]] = {
    "int": (int,),
    "str": (str,),
    "float": (int, float),
    "bool": (bool,),
    "None": (type(None),),
    "list": (list,),
    "dict": (dict,),
    "RequestId": (int, str, type(None)),
    "TurnRequest": (dict,),
    "TurnResult": (dict,),
    "RowOutcome": (dict,),
    "CacheFileReport": (dict,),
}


class _Message:
    TYPE: ClassVar[str]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)  # type: ignore[call-overload]

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Any:
        return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data})  # type: ignore[arg-type]


# -- the front end to rank 0 ----------------------------------------------------------


@dataclass
class Hello(_Message):
    """Rank 0's first message on a new connection: the token the front end made."""

    TYPE: ClassVar[str] = "hello"
    token: str
    ranks: int | None = None


@dataclass
class Welcome(_Message):
    """The front end took the token: the connection is rank 0's."""

    TYPE: ClassVar[str] = "welcome"


@dataclass
class Refused(_Message):
    """A connection that did not present the token, answered once before it is closed."""

    TYPE: ClassVar[str] = "refused"
    reason: str


@dataclass
class Turn(_Message):
    TYPE: ClassVar[str] = "turn"
    id: int
    request: TurnRequest

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Turn:
        return cls(data["id"], TurnRequest.from_dict(data["request"]))


@dataclass
class BatchRow:
    """One request of a batch, under its own id."""

    id: int
    request: TurnRequest


@dataclass
class Batch(_Message):
    """Several requests decoded together (exokv.rank.batch), in the front end's order."""

    TYPE: ClassVar[str] = "batch"
    id: int
    rows: list[BatchRow]
    join: bool = False  # later requests may join it at a decode step (a `join` message)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Batch:
        rows = [BatchRow(r["id"], TurnRequest.from_dict(r["request"])) for r in data["rows"]]
        return cls(data["id"], rows, bool(data.get("join", False)))


@dataclass
class Join(_Message):
    """Requests that join the batch in flight at its next decode step (exokv.rank.joins);
    sent by the front end, kept by rank 0 (never broadcast as a message of its own)."""

    TYPE: ClassVar[str] = "join"
    rows: list[BatchRow]

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Join:
        rows = [BatchRow(r["id"], TurnRequest.from_dict(r["request"])) for r in data["rows"]]
        return cls(rows)


@dataclass
class Stop(_Message):
    """End the turn, or the batch's row, with this id at its next token (Ctrl-C)."""

    TYPE: ClassVar[str] = "stop"
    id: RequestId


@dataclass
class Seen(_Message):
    """The front end has handled the texts message of `step` (exokv.rank.textflow)."""

    TYPE: ClassVar[str] = "seen"
    step: int


@dataclass
class Draft(_Message):
    """The user's unsent line, to prefill ahead of Enter (exokv.rank.typeahead); an
    empty `draft` abandons the one before."""

    TYPE: ClassVar[str] = "draft"
    id: str
    session: str
    messages: list[dict[str, Any]]
    draft: str
    # The step's tokens, decided by rank 0 for every rank (exokv.rank.pace); 0: unset.
    step_tokens: int = 0


@dataclass
class Save(_Message):
    """/save: write the conversation's cached path to every rank's disk tier."""

    TYPE: ClassVar[str] = "save"
    id: int
    session: str
    messages: list[dict[str, Any]]


@dataclass
class Held(_Message):
    """At resume: how much of the conversation the ranks' restored tree holds."""

    TYPE: ClassVar[str] = "held"
    id: int
    session: str
    messages: list[dict[str, Any]]


@dataclass
class Shutdown(_Message):
    """End the ranks cleanly (the disk tier keeps the cache); also what rank 0 tells
    the others when the front end is gone."""

    TYPE: ClassVar[str] = "shutdown"


# -- rank 0 to the front end ----------------------------------------------------------


@dataclass
class Status(_Message):
    """What the ranks are doing while they start."""

    TYPE: ClassVar[str] = "status"
    message: str


@dataclass
class Ready(_Message):
    """The model is loaded on every rank: each rank's effective budget (None: none)."""

    TYPE: ClassVar[str] = "ready"
    ranks: int
    budgets: list[int | None]
    notice: str | None = None  # why the disk tier is cold, or a torn record
    template_note: str | None = None  # the chat template chosen for the model, if a fallback
    # The disk tier's pool under each host's EXOKV_HOME/kv ("" without a tier) and every
    # rank's [start, end) layers: where the front end copies replicas (exokv.client.replicate).
    tier_pool: str = ""
    layers: list[list[int]] = field(default_factory=list)
    # Each rank's bytes of K/V per token and the model's context (None: unknown): what a
    # server's default batch is sized from (exokv.serve.rows).
    kv_per_token: list[int] = field(default_factory=list)
    context: int | None = None


@dataclass
class Heartbeat(_Message):
    TYPE: ClassVar[str] = "heartbeat"


@dataclass
class Progress(_Message):
    """Prefill of request `id`: `done` of `total` tokens."""

    TYPE: ClassVar[str] = "progress"
    id: RequestId
    done: int
    total: int


@dataclass
class Texts(_Message):
    """Every request's text since the last texts message: [id, text] pairs
    (exokv.rank.textflow); answered with `Seen(step)`."""

    TYPE: ClassVar[str] = "texts"
    step: int
    pieces: list[list[Any]]


@dataclass
class Result(_Message):
    """A turn's end (the result carries the reply's exact tokens)."""

    TYPE: ClassVar[str] = "result"
    id: RequestId
    result: TurnResult

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Result:
        return cls(data["id"], TurnResult.from_dict(data["result"]))


@dataclass
class TurnRefused(_Message):
    """A turn no rank ran: its prompt is over the model's context."""

    TYPE: ClassVar[str] = "turn_refused"
    id: RequestId
    message: str
    tokens: int = 0
    context: int = 0


@dataclass
class Row(_Message):
    """One row of a batch ended: its outcome; `tokens`: the reply's exact tokens (the
    client puts them on the outcome's result, as a turn's result has them)."""

    TYPE: ClassVar[str] = "row"
    id: int
    outcome: RowOutcome
    tokens: list[int] | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Row:
        return cls(data["id"], RowOutcome.from_dict(data["outcome"]), data.get("tokens"))


@dataclass
class Report(_Message):
    """The answer to a `Save` or a `Held`."""

    TYPE: ClassVar[str] = "report"
    id: int
    report: CacheFileReport

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Report:
        return cls(data["id"], CacheFileReport.from_dict(data["report"]))


@dataclass
class Drafted(_Message):
    """The draft `id` gets no more steps (a client may wait for that)."""

    TYPE: ClassVar[str] = "drafted"
    id: str


@dataclass
class DraftStep(_Message):
    """A typeahead step ran: the draft's prompt tokens and how many the tree holds now
    (rank 0's word, for the front end's toolbar)."""

    TYPE: ClassVar[str] = "draft_step"
    session: str
    tokens: int
    cached: int


@dataclass
class RankFailed(_Message):
    """A rank's error, in one line, before it exits."""

    TYPE: ClassVar[str] = "error"
    rank: int
    message: str


Message = (
    Hello
    | Welcome
    | Refused
    | Turn
    | Batch
    | Join
    | Stop
    | Seen
    | Draft
    | Save
    | Held
    | Shutdown
    | Status
    | Ready
    | Heartbeat
    | Progress
    | Texts
    | Result
    | TurnRefused
    | Row
    | Report
    | Drafted
    | DraftStep
    | RankFailed
)

_CLASSES: dict[str, type[_Message]] = {
    cls.TYPE: cls
    for cls in (
        Hello,
        Welcome,
        Refused,
        Turn,
        Batch,
        Join,
        Stop,
        Seen,
        Draft,
        Save,
        Held,
        Shutdown,
        Status,
        Ready,
        Heartbeat,
        Progress,
        Texts,
        Result,
        TurnRefused,
        Row,
        Report,
        Drafted,
        DraftStep,
        RankFailed,
    )
}


def encode(message: Message) -> dict[str, Any]:
    """The JSON object `message` travels as: its fields and its "type"."""
    return {"type": message.TYPE, **message.to_dict()}


def decode(data: Any) -> Message:
    """The message a JSON object is; MessageError, in one line, if it is none."""
    if not isinstance(data, dict) or not isinstance(data.get("type"), str):
        raise MessageError("a message that is not a JSON object with a type")
    kind = data["type"]
    cls = _CLASSES.get(kind)
    if cls is None:
        raise MessageError(f"a message of unknown type {kind[:40]!r}")
    for f in fields(cls):  # type: ignore[arg-type]
        if f.name not in data:
            if f.default is MISSING and f.default_factory is MISSING:
                raise MessageError(f"a {kind!r} message without its {f.name!r}")
            continue
        allowed = _allowed(str(f.type))
        if allowed and not isinstance(data[f.name], allowed):
            raise MessageError(f"a {kind!r} message whose {f.name!r} is not {f.type}")
    try:
        return cls.from_dict(data)
    except (TypeError, ValueError, KeyError, AttributeError) as err:
        raise MessageError(f"a malformed {kind!r} message ({type(err).__name__})") from None


def _allowed(annotation: str) -> tuple[type, ...]:
    """The types an annotation such as "int | None" or "list[int]" allows; () for any."""
    kinds: tuple[type, ...] = ()
    for part in re.sub(r"\[.*?\]+", "", annotation).split("|"):  # the outer types alone
        name = part.strip()
        if name not in _KINDS:
            return ()
        kinds += _KINDS[name]
    return kinds
