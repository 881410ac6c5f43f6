"""Rows decoded together (exokv.rank.batch) against the same turns one at a time."""

from __future__ import annotations

from exokv.core.records import TurnRequest
from exokv.rank.batch import batchable, run_batch
from exokv.rank.engine import Engine, EngineOptions
from exokv.rank.pace import Pace

SYSTEM = "You are a terse assistant that answers in one line."
QUESTIONS = ["Hi there.", "What is rain?", "Pick a colour.", "Who are you?", "Count to three."]


def engine(tiny, **options) -> Engine:
    model, tokenizer = tiny
    return Engine(model, tokenizer, options=EngineOptions(**options))


class FixedPace(Pace):
    """Chunks of 512 tokens whatever the measured rate (a loaded machine's is low)."""

    def tokens(self) -> int:
        return 512


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


def test_requests_that_join_at_a_decode_step_reply_as_one_at_a_time(tiny) -> None:
    """Rows joining a running batch (one with a long prompt, prefilled a chunk per step
    while the others decode) reply as one at a time; the tree holds the same."""
    reqs = requests([40, 30])
    long_prompt = [{"role": "system", "content": SYSTEM}]
    long_prompt.append({"role": "user", "content": " ".join(QUESTIONS) * 12})
    late = [*requests([1, 1, 8])[2:], TurnRequest(session="long", messages=long_prompt)]
    late[-1].max_tokens = 10
    alone = engine(tiny)
    expected = [alone.turn(r) for r in reqs + late]
    together = engine(tiny)
    together.join_pace = Pace(most=32)  # chunks of at most 32 tokens: several for the long one
    given, log = [0], []

    def joins() -> list[TurnRequest]:
        # The first joins once the first rows decode, the long one a few steps later.
        steps = sum(1 for e in log if e == ("step", -1))
        if given[0] < len(late) and ("text", 0) in log and steps >= 3 * (given[0] + 1):
            given[0] += 1
            return late[given[0] - 1 : given[0]]
        return []

    outcomes = run_batch(
        together,
        reqs,
        on_text=lambda i, p: log.append(("text", i)),
        on_progress=lambda i, d, t: log.append(("progress", i)),
        on_step=lambda: log.append(("step", -1)),
        joins=joins,
    )
    assert len(outcomes) == len(expected)
    for want, got in zip(expected, outcomes, strict=True):
        assert got.result is not None and got.result.reply == want.reply
        assert got.result.finish_reason == want.finish_reason
    assert outcomes[2].batch >= 3 and outcomes[3].batch >= 2  # decoded with the others
    # The long prompt's prefill ran in several chunks, a decode step between each two,
    # while the first row decoded on (its text before the first chunk and after the last).
    mine = [k for k, e in enumerate(log) if e == ("progress", 3)]
    assert len(mine) >= 4
    assert all(("step", -1) in log[a:b] for a, b in zip(mine[1:], mine[2:], strict=False))
    assert ("text", 0) in log[: mine[0]] and ("text", 0) in log[mine[-1] :]
    assert together.cache.total_bytes == alone.cache.total_bytes


def test_a_lone_joinable_request_replies_as_its_turn(tiny) -> None:
    reqs = requests([12])
    want = engine(tiny).turn(reqs[0])
    got = run_batch(engine(tiny), reqs, joins=lambda: [])
    assert got[0].result is not None and got[0].result.reply == want.reply
    assert got[0].batch == 1


def test_a_joining_row_fetches_the_prompt_a_running_row_shares(tiny) -> None:
    """A running row's prompt is in the tree once prefilled: a newcomer with the same
    system prompt fetches it then, not only after that row's reply ends."""
    first, later = requests([40, 6])
    eng = engine(tiny)
    shared = eng.render(first.messages)
    other = eng.render(later.messages)
    common = next(i for i, (a, b) in enumerate(zip(shared, other, strict=False)) if a != b)
    texts: list[int] = []

    def joins() -> list[TurnRequest]:
        if len(texts) == 2:  # the first row decodes: its prompt was prefilled
            texts.append(-1)
            return [later]
        return []

    outcomes = run_batch(eng, [first], on_text=lambda i, p: texts.append(i), joins=joins)
    assert outcomes[1].result is not None and outcomes[1].result.cached_tokens >= common > 10
    assert outcomes[0].result.generated_tokens > outcomes[1].result.generated_tokens
    assert outcomes[1].result.reply == engine(tiny).turn(later).reply


def test_newcomers_prefill_together_in_one_pass_and_reply_as_one_at_a_time(
    tiny, monkeypatch
) -> None:
    """Newcomers admitted at one step, each its own question after the system prompt a
    running row stored, are prefilled in one forward pass (right-padded), and still
    reply as one at a time; the tree holds the same."""
    import exokv.rank.batch as batch_module

    passes: list[int] = []
    together_pass = batch_module.prefill_together

    def counted(model, caches, slices):  # noqa: ANN001, ANN202 - a spy on the pass
        passes.append(len(slices))
        return together_pass(model, caches, slices)

    monkeypatch.setattr(batch_module, "prefill_together", counted)
    first, *late = requests([30, 6, 9, 4, 7])
    alone = engine(tiny)
    expected = [alone.turn(r) for r in [first, *late]]
    eng = engine(tiny)
    eng.join_pace = FixedPace()  # one chunk holds every newcomer's question, any load
    texts: list[int] = []

    def joins() -> list[TurnRequest]:
        if len(texts) == 2:  # the first row decodes: its prompt is in the tree
            texts.append(-1)
            return late
        return []

    outcomes = run_batch(eng, [first], on_text=lambda i, p: texts.append(i), joins=joins)
    assert passes and max(passes) == len(late)  # the four newcomers in one pass
    for want, got in zip(expected, outcomes, strict=True):
        assert got.result is not None and got.result.reply == want.reply
        assert got.result.finish_reason == want.finish_reason
    assert all(o.result.cached_tokens > 0 for o in outcomes[1:])  # the system prompt
    assert eng.cache.total_bytes == alone.cache.total_bytes


def test_newcomers_take_the_slots_of_rows_that_ended_and_reply_as_one_at_a_time(
    tiny, monkeypatch
) -> None:
    """A row that ends leaves its slot vacant; a newcomer whose cache fits is written
    into it (no copy of the batch), one that does not fit is appended, and the
    vacancies left over are compacted away: every reply still as one at a time."""
    import exokv.rank.batch as batch_module

    placed: list[int] = []
    compacted: list[int] = []
    place, compact_now = batch_module.slots.place, batch_module.slots.compact_now

    def spy_place(layers, slot, cache):  # noqa: ANN001, ANN202 - a spy on the slot
        placed.append(slot)
        return place(layers, slot, cache)

    def spy_compact(vacant, *args):  # noqa: ANN001, ANN202 - a spy on the decision
        now = compact_now(vacant, *args)
        if now and vacant:
            compacted.append(len(vacant))
        return now

    monkeypatch.setattr(batch_module.slots, "place", spy_place)
    monkeypatch.setattr(batch_module.slots, "compact_now", spy_compact)
    first = requests([2, 3, 40, 36])
    long_prompt = [{"role": "system", "content": SYSTEM}]
    long_prompt.append({"role": "user", "content": " ".join(QUESTIONS) * 8})
    late = [*requests([1, 1, 1, 1, 9, 12, 7])[4:]]
    late.append(TurnRequest(session="long", messages=long_prompt, max_tokens=5))
    alone = engine(tiny)
    expected = [alone.turn(r) for r in first + late]
    eng = engine(tiny)
    eng.join_pace = FixedPace()
    ended: list[int] = []

    def joins() -> list[TurnRequest]:
        if len(ended) == 2:  # the two short rows ended: their slots are vacant
            ended.append(-1)
            return late
        return []

    outcomes = run_batch(eng, first, on_row=lambda i, o: ended.append(i), joins=joins)
    assert sorted(placed) == [0, 1]  # two newcomers in the two vacancies, two appended
    assert compacted  # the vacancies of the rows that ended last were removed
    for want, got in zip(expected, outcomes, strict=True):
        assert got.result is not None and got.result.reply == want.reply
        assert got.result.generated_tokens == want.generated_tokens
        assert got.result.finish_reason == want.finish_reason
    assert eng.cache.total_bytes == alone.cache.total_bytes
