"""The wire's messages (exokv.wire.messages): each one survives encode, JSON and decode
unchanged, and what is not a message is refused in one line."""

from __future__ import annotations

import json

import pytest

from exokv.core.records import CacheEvent, CacheFileReport, RowOutcome, TurnRequest, TurnResult
from exokv.wire import messages as m

# A reply's message carries its exact tokens, and a result the reply's: both travel.
REPLY = {"role": "assistant", "content": "yo", "tokens": [5, 6]}
REQUEST = TurnRequest(
    "s", [{"role": "user", "content": "hi"}, REPLY, {"role": "user", "content": "and?"}],
    max_tokens=8, seed=3,
)  # fmt: skip
RESULT = TurnResult(
    "s", "hello", 10, 4, 6, 2, 0.1, 20.0, 0.01, 2,
    events=[CacheEvent("add", 1, 2, 6, [100, 120], session="s")], reply_tokens=[7, 8],
)  # fmt: skip

EXAMPLES: list[m.Message] = [
    m.Hello("0" * 64, ranks=2),
    m.Welcome(),
    m.Refused("wrong token"),
    m.Turn(1, REQUEST),
    m.Batch(2, [m.BatchRow(3, REQUEST), m.BatchRow(4, TurnRequest("t", []))]),
    m.Join([m.BatchRow(5, REQUEST)]),
    m.Stop(3),
    m.Seen(12),
    m.Draft("draft-1", "s", [{"role": "user", "content": "hi"}], "and then"),
    m.Save(5, "s", [{"role": "user", "content": "hi"}]),
    m.Held(6, "s", []),
    m.Shutdown(),
    m.Status("loading the model"),
    m.Ready(2, [1000, None], notice="", kv_per_token=[3072, 1536], context=2048),
    m.Heartbeat(),
    m.Progress(1, 30, 40),
    m.Texts(12, [[3, "he"], [4, "llo"]]),
    m.Result(1, RESULT),
    m.TurnRefused(1, "the prompt is over the context", tokens=9000, context=8192),
    m.Row(3, RowOutcome(result=RESULT, batch=2), tokens=None),
    m.Row(4, RowOutcome(refused="too long", tokens=9000, context=8192)),
    m.Report(5, CacheFileReport("s", tokens=6, bytes=[1, 2], paths=["a", "b"])),
    m.Drafted("draft-1"),
    m.DraftStep("chat-1", 1234, 1200),
    m.RankFailed(1, "RuntimeError: injected failure in decode"),
]


def test_every_message_class_has_an_example() -> None:
    assert {type(e) for e in EXAMPLES} == set(m._CLASSES.values())


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda e: type(e).__name__)
def test_every_message_round_trips_through_json(message: m.Message) -> None:
    data = json.loads(json.dumps(m.encode(message)))
    assert data["type"] == message.TYPE
    assert m.decode(data) == message


@pytest.mark.parametrize(
    ("data", "says"),
    [
        ({"type": "nonsense"}, "unknown type 'nonsense'"),
        ({"no": "type"}, "not a JSON object with a type"),
        ([1, 2], "not a JSON object with a type"),
        ({"type": 7}, "not a JSON object with a type"),
        ({"type": "turn", "id": 1}, "without its 'request'"),
        ({"type": "stop"}, "without its 'id'"),
        ({"type": "progress", "id": 1, "done": "half", "total": 4}, "'done' is not int"),
        ({"type": "turn", "id": 1, "request": {"session": "s"}}, "malformed 'turn'"),
        ({"type": "batch", "id": 1, "rows": [{"id": 2}]}, "malformed 'batch'"),
    ],
)
def test_what_is_not_a_message_is_refused_in_one_line(data: object, says: str) -> None:
    with pytest.raises(m.MessageError) as info:
        m.decode(data)
    assert says in str(info.value) and "\n" not in str(info.value)
