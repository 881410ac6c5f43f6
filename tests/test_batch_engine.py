"""Rows decoded together (exokv.rank.batch) against the same turns one at a time."""

from __future__ import annotations

from exokv.rank.batch import batchable, run_batch
from exokv.rank.engine import Engine, EngineOptions
from exokv.records import TurnRequest

SYSTEM = "You are a terse assistant that answers in one line."
QUESTIONS = ["Hi there.", "What is rain?", "Pick a colour.", "Who are you?", "Count to three."]


def engine(tiny, **options) -> Engine:
    model, tokenizer = tiny
    return Engine(model, tokenizer, options=EngineOptions(**options))


def requests(max_tokens: list[int]) -> list[TurnRequest]:
    out = []
    for i, n in enumerate(max_tokens):
        messages = [{"role": "system", "content": SYSTEM}]
        messages.append({"role": "user", "content": QUESTIONS[i % len(QUESTIONS)] * (1 + i % 3)})
        out.append(TurnRequest(session=f"s{i}", messages=messages, max_tokens=n))
    return out


def test_a_batch_replies_as_one_at_a_time_and_stores_the_same_tree(tiny) -> None:
    reqs = requests([12, 5, 20, 1, 16, 9])
    alone = engine(tiny)
    expected = [alone.turn(r) for r in reqs]
    together = engine(tiny)
    streamed: dict[int, str] = {}
    outcomes = run_batch(
        together, reqs, on_text=lambda i, p: streamed.__setitem__(i, streamed.get(i, "") + p)
    )
    assert [o.batch for o in outcomes] == [len(reqs)] * len(reqs)
    for i, (want, got) in enumerate(zip(expected, outcomes, strict=True)):
        assert got.result is not None
        assert got.result.reply == want.reply
        assert got.result.generated_tokens == want.generated_tokens
        assert got.result.finish_reason == want.finish_reason
        assert streamed.get(i, "") == want.reply
    # The shared system prompt is stored once, and the tree holds what one at a time holds.
    assert together.cache.total_bytes == alone.cache.total_bytes
    # A second turn of each conversation hits its whole first turn.
    follow = []
    for r, o in zip(reqs, outcomes, strict=True):
        messages = [*r.messages, {"role": "assistant", "content": o.result.reply}]
        messages.append({"role": "user", "content": "And then?"})
        follow.append(TurnRequest(session=r.session, messages=messages, max_tokens=6))
    again = run_batch(together, follow)
    for o, first in zip(again, outcomes, strict=True):
        assert o.result.cached_tokens >= first.result.prompt_tokens


def test_a_stopped_row_ends_alone(tiny) -> None:
    reqs = requests([30, 30, 30])
    expected = [engine(tiny).turn(r) for r in reqs]
    seen = {0: 0, 1: 0, 2: 0}

    def on_text(i: int, piece: str) -> None:
        seen[i] += 1

    outcomes = run_batch(
        engine(tiny), reqs, on_text=on_text, should_stop=lambda i: i == 1 and seen[1] >= 3
    )
    assert outcomes[1].result.finish_reason == "interrupted"
    assert outcomes[1].result.generated_tokens < 30
    for i in (0, 2):
        assert outcomes[i].result.reply == expected[i].reply


def test_a_budget_holds_after_every_row(tiny) -> None:
    reqs = requests([10] * 5)
    probe = engine(tiny)
    budget = probe.bytes_per_token * 60  # less than the five conversations
    eng = engine(tiny, budget=budget)
    outcomes = run_batch(eng, reqs)
    for o in outcomes:
        assert all(s.cache_bytes <= budget for s in o.result.rank_stats)
    assert eng.cache.total_bytes <= budget


def test_a_rotating_cache_runs_one_at_a_time(tiny) -> None:
    eng = engine(tiny, max_kv_size=64)
    assert not batchable(eng)
    reqs = requests([6, 6])
    outcomes = run_batch(eng, reqs)
    assert [o.batch for o in outcomes] == [1, 1]
    assert [o.result.reply for o in outcomes] == [
        engine(tiny, max_kv_size=64).turn(r).reply for r in reqs
    ]


def test_a_row_is_answered_when_it_ends_while_the_others_decode_on(tiny) -> None:
    reqs = requests([3, 24, 1, 12])
    streamed: dict[int, str] = {}
    answered: list[tuple[int, dict[int, str]]] = []  # (row, what every row had streamed)
    eng = engine(tiny)

    def on_row(i: int, outcome) -> None:
        assert outcome.result is not None and outcome.batch == len(reqs)
        # Its tokens are in the tree already: a second turn of it would be served them.
        assert eng.cache.tree.match(eng.render(reqs[i].messages)).length > 0
        answered.append((i, dict(streamed)))

    outcomes = run_batch(
        eng,
        reqs,
        on_text=lambda i, p: streamed.__setitem__(i, streamed.get(i, "") + p),
        on_row=on_row,
    )
    # Shortest first, each before the longer rows had made their whole reply.
    assert [i for i, _ in answered] == [2, 0, 3, 1]
    for i, seen in answered[:-1]:
        assert seen[i] == outcomes[i].result.reply
        assert len(seen[1]) < len(outcomes[1].result.reply), (i, seen)
    alone = engine(tiny)
    assert [o.result.reply for o in outcomes] == [alone.turn(r).reply for r in reqs]


def test_rows_that_sample_differently_keep_their_own_sampler(tiny) -> None:
    # A sampling row among greedy ones: each row gets its own sampler call, by its place
    # in the batch even after shorter rows have left it; the greedy rows stay exact.
    reqs = requests([14, 4, 18, 7])
    reqs[0].temp, reqs[0].top_p = 0.9, 0.8
    reqs[2].temp = 0.0
    expected = [engine(tiny).turn(r) for r in reqs]
    outcomes = run_batch(engine(tiny), reqs)
    assert [o.batch for o in outcomes] == [4] * 4
    for i in (1, 2, 3):
        assert outcomes[i].result.reply == expected[i].reply
        assert outcomes[i].result.generated_tokens == expected[i].generated_tokens
    sampled = outcomes[0].result
    assert 1 <= sampled.generated_tokens <= 14 and sampled.finish_reason in ("stop", "length")
