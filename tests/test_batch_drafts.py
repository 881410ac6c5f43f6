"""Batch rows with drafts (exokv.rank.batch_drafts) against the same rows without."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import BatchKVCache, KVCache

from exokv.core.records import TurnRequest
from exokv.rank import batch_drafts, slots
from exokv.rank.batch import run_batch
from exokv.rank.draft import Drafter
from exokv.rank.engine import Engine, EngineOptions

SYSTEM = "You are a terse assistant that answers in one line."
QUESTIONS = ["Hi there.", "What is rain?", "Pick a colour.", "Who are you?", "Count to three."]


def test_trim_rows_takes_each_rows_own_count_off_its_end() -> None:
    rows = [KVCache() for _ in range(3)]
    lengths = [5, 2, 7]
    for c, n in zip(rows, lengths, strict=True):
        c.update_and_fetch(*(mx.arange(n * 4, dtype=mx.float32).reshape(1, 1, n, 4),) * 2)
    batch = BatchKVCache.merge(rows)
    width = 4  # a pass of one token and a draft of three, per row
    new = mx.arange(100, 100 + 3 * width * 4, dtype=mx.float32).reshape(3, 1, width, 4)
    batch.update_and_fetch(new, new)
    cuts = [3, 0, 2]
    batch_drafts.trim_rows([batch], cuts)
    assert batch.offset.tolist() == [n + width - c for n, c in zip(lengths, cuts, strict=True)]
    for j, (c, n) in enumerate(zip(rows, lengths, strict=True)):
        want = mx.concatenate([c.keys[..., :n, :], new[j : j + 1, :, : width - cuts[j]]], axis=2)
        got = batch.extract(j)
        assert got.offset == n + width - cuts[j]
        assert mx.array_equal(got.keys, want) and mx.array_equal(got.values, want)
    # The next token goes right after each row's own last one.
    one = mx.full((3, 1, 1, 4), -1.0)
    batch.update_and_fetch(one, one)
    for j in range(3):
        assert batch.extract(j).keys[0, 0, -1].tolist() == [-1.0] * 4


def test_pass_tokens_pads_each_draft_with_its_rows_token() -> None:
    got = batch_drafts.pass_tokens([7, 8, 9], [[1, 2], [], [3]]).tolist()
    assert got == [[7, 1, 2], [8, 8, 8], [9, 3, 9]]


class _Scripted(Drafter):
    """Drafts a row's reply from what plain decoding gave it: right tokens, with every
    `wrong`-th one made wrong (0: none), so a pass meets rows that keep all, some and
    none of their drafts."""

    def __init__(self, tokens, script: list[int], wrong: int) -> None:
        super().__init__(tokens)
        self.prompt, self.script, self.wrong = len(tokens), script, wrong

    def propose(self, k: int) -> list[int]:
        at = len(self.lookup.tokens) - self.prompt
        out = self.script[at : at + k]
        if not self.wrong:
            return out
        return [t + 1 if (at + i) % self.wrong == self.wrong - 1 else t for i, t in enumerate(out)]


def _engine(tiny) -> Engine:
    model, tokenizer = tiny
    return Engine(model, tokenizer, options=EngineOptions())


def _requests(max_tokens: list[int], speculate: bool) -> list[TurnRequest]:
    out = []
    for i, n in enumerate(max_tokens):
        messages = [{"role": "system", "content": SYSTEM}]
        messages.append({"role": "user", "content": QUESTIONS[i % len(QUESTIONS)] * (1 + i % 3)})
        out.append(TurnRequest(f"s{i}", messages, max_tokens=n, speculate=speculate))
    return out


@pytest.fixture
def scripted(monkeypatch, tiny):
    """Rows' drafts from their plain replies: row i's tokens wrong every WRONG[i]-th
    (0: all right; 1: all wrong); returns the plain outcomes."""
    wrong = [0, 3, 1, 2, 0, 4]
    plain_engine = _engine(tiny)
    reqs = _requests([24, 30, 18, 27, 6, 22], speculate=False)
    plain = run_batch(plain_engine, reqs)
    scripts = {}
    for i, (r, o) in enumerate(zip(reqs, plain, strict=True)):
        prompt = tuple(plain_engine.render(r.messages))
        scripts[prompt] = (list(o.result.reply_tokens) + [0] * 8, wrong[i])

    def drafter(tokens) -> Drafter:
        script, every = scripts.get(tuple(tokens), ([], 0))
        return _Scripted(tokens, script, every)

    monkeypatch.setattr(batch_drafts, "Drafter", drafter)
    # Drafting on at every step, whatever this machine's clock says it is worth.
    monkeypatch.setattr(batch_drafts.Switch, "wanted", lambda self: 1)
    return plain_engine, plain


@pytest.mark.parametrize("after_an_end", [False, True])
def test_rows_with_drafts_reply_as_rows_without_and_store_the_same(
    tiny, scripted, monkeypatch, after_an_end
) -> None:
    plain_engine, plain = scripted
    eng = _engine(tiny)
    late = _requests([24, 30, 18, 27, 6, 22], speculate=True)
    given = [False]
    placed = []  # newcomers written into the slots of rows that ended (exokv.rank.slots)
    place = slots.place
    monkeypatch.setattr(slots, "place", lambda *a: (placed.append(a[1]), place(*a))[1])

    def joins() -> list[TurnRequest]:  # the last two join a few steps in, or once row 0 ended
        ready = streamed.get(0) == plain[0].result.reply if after_an_end else eng.decision >= 4
        if not given[0] and ready:
            given[0] = True
            return late[4:]
        return []

    streamed: dict[int, str] = {}
    outcomes = run_batch(
        eng,
        late[:4],
        on_text=lambda i, p: streamed.__setitem__(i, streamed.get(i, "") + p),
        joins=joins,
    )
    assert len(outcomes) == 6
    for i, (want, got) in enumerate(zip(plain, outcomes, strict=True)):
        assert got.result.reply == want.result.reply, i
        assert got.result.reply_tokens == want.result.reply_tokens
        assert got.result.finish_reason == want.result.finish_reason
        assert streamed.get(i, "") == want.result.reply
        assert got.result.speculation == "" and want.result.speculation == "off"
    drafted = [o.result.draft_tokens for o in outcomes]
    kept = [o.result.accepted_tokens for o in outcomes]
    assert all(d > 0 for d in drafted), drafted
    assert kept[0] >= outcomes[0].result.generated_tokens // 2  # right drafts: most kept
    assert kept[2] == 0  # all wrong: none kept
    assert 0 < kept[1] < drafted[1]  # partly wrong: some kept
    # Every row's cache held exactly its own tokens: the tree is the plain batch's, and
    # a second turn of each conversation (served its first from the tree) is alike.
    assert eng.cache.total_bytes == plain_engine.cache.total_bytes
    again = []
    for e, outs in ((plain_engine, plain), (eng, outcomes)):
        follow = []
        for r, o in zip(late, outs, strict=True):
            messages = [*r.messages, {"role": "assistant", "content": o.result.reply}]
            messages.append({"role": "user", "content": "And then?"})
            follow.append(TurnRequest(r.session, messages, max_tokens=6, speculate=False))
        again.append([o.result.reply for o in run_batch(e, follow)])
    assert again[0] == again[1]
    # Joining early they are appended; after row 0 ended, one takes its slot.
    assert (len(placed) > 0) == after_an_end, placed


def test_no_speculate_rows_draft_nothing(tiny, scripted) -> None:
    _, plain = scripted
    outcomes = run_batch(_engine(tiny), _requests([24, 30, 18, 27, 6, 22], speculate=False))
    assert [o.result.reply for o in outcomes] == [o.result.reply for o in plain]
    assert all(o.result.draft_tokens == 0 for o in outcomes)
    assert all(o.result.speculation == "off" for o in outcomes)


def test_a_sampling_row_with_drafts_ends_within_its_tokens(tiny, scripted) -> None:
    reqs = _requests([24, 30, 18, 27, 6, 22], speculate=True)
    reqs[0].temp, reqs[0].top_p = 0.8, 0.9
    outcomes = run_batch(_engine(tiny), reqs)
    _, plain = scripted
    for i in range(1, 6):
        assert outcomes[i].result.reply == plain[i].result.reply
    first = outcomes[0].result
    assert first.draft_tokens > 0
    assert 1 <= first.generated_tokens <= 24 and first.finish_reason in ("stop", "length")


def test_a_row_is_waited_for_only_when_its_lookup_could_find_a_draft() -> None:
    row = batch_drafts.RowDrafter([5, 6, 7])
    row.catch_up([8])
    assert not row.may_find()  # 8 was never followed by anything: no tail can match
    row.catch_up([8, 6])
    assert row.may_find()  # 6 was followed by 7: the next token may make (6, x) match
    row.catch_up([8, 6, 7])
    assert row.drafter.propose(2) == [8, 6]  # it did: what followed (6, 7) before


def test_drafting_goes_off_while_its_steps_are_slower_and_is_tried_again() -> None:
    switch = batch_drafts.Switch()
    assert switch.wanted() == 1  # nothing measured: draft, which measures it
    for drafted, tokens in ((False, 8), (True, 12), (False, 8), (True, 12)):
        switch.ran(drafted, tokens)
        switch.took(0.1)  # 120 tokens/s drafting against 80 plain: on
    assert switch.wanted() == 1
    for _ in range(3):
        switch.ran(True, 10)
        switch.took(0.5)  # 20 tokens/s: off
    assert [switch.wanted() for _ in range(batch_drafts.PROBE_EVERY)][-2:] == [0, 1]
    assert switch.wanted() == 0


def test_a_row_with_logprobs_decodes_alone_among_rows_that_draft(tiny, scripted) -> None:
    _, plain = scripted
    reqs, plain_reqs = (_requests([24, 30, 18, 27, 6, 22], speculate=s) for s in (True, False))
    for r in (reqs[1], plain_reqs[1]):
        r.logprobs = 2
    got, want = (run_batch(_engine(tiny), rs) for rs in (reqs, plain_reqs))
    assert [o.result.reply for o in got] == [o.result.reply for o in plain]
    assert got[1].result.draft_tokens == 0 and "logprobs" in got[1].result.speculation
    assert got[0].result.draft_tokens > 0
    mine, theirs = got[1].result.logprobs, want[1].result.logprobs
    assert [(e[0], [t for t, _ in e[2]]) for e in mine] == [
        (e[0], [t for t, _ in e[2]]) for e in theirs
    ]
    for a, b in zip(mine, theirs, strict=True):  # [text, logprob, top]
        assert abs(a[1] - b[1]) < 1e-4
