"""A draft decision that cannot find anything must cost nothing (issue 46).

A plain step is computed ahead: its forward pass starts before the token before it
is known. A step that asks for a draft cannot be, so it is asked only where prompt
lookup could find something after the coming token (or another source, the tree or a
draft model, may draft). A fake model whose every position has a fixed next token
makes the replies, and so the steps, exact.
"""

from __future__ import annotations

import random
from typing import Any

import mlx.core as mx

from exokv.rank import draft as draft_mod
from exokv.rank import speculate
from exokv.rank.draft import NOT_WORTH, NOTHING, Drafter, PassCost, PromptLookup

VOCAB = 300


class _Cache:
    def __init__(self, offset: int) -> None:
        self.offset = offset

    def trim(self, n: int) -> None:
        self.offset -= n

    @property
    def state(self) -> mx.array:
        return mx.array([self.offset])


class _Script:
    """A model whose choice after position p is script[p - start], whatever came."""

    def __init__(self, script: list[int], start: int) -> None:
        self.script, self.start, self.passes = script, start, 0

    def __call__(self, tokens: mx.array, cache: list[_Cache]) -> mx.array:
        n = tokens.shape[1]
        at = cache[0].offset - self.start
        cache[0].offset += n
        self.passes += 1
        rows = [self.script[min(at + i, len(self.script) - 1)] for i in range(n)]
        return mx.eye(VOCAB)[mx.array(rows)][None] * 10.0


class _Detokenizer:
    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.text, self.last_segment = "", ""

    def add_token(self, token: int) -> None:
        self.last_segment = f"<{token}>"
        self.text += self.last_segment

    def finalize(self) -> None:
        self.last_segment = ""


class _Tokenizer:
    eos_token_ids = [VOCAB - 1]

    def __init__(self) -> None:
        self.detokenizer = _Detokenizer()


def _decode(prompt: list[int], reply: list[int], drafter: Drafter) -> Any:
    tokenizer = _Tokenizer()
    start = len(prompt) - 1  # all but the last prompt token are in the cache
    model = _Script(reply, start)
    steps = speculate.StepAgreement(_OneRank(), None)
    out = speculate.decode(
        model, tokenizer, prompt[-1], [_Cache(start)], len(reply), 0.0, drafter, steps
    )
    assert out.tokens == reply  # drafts or not, the model's own reply
    return out


class _OneRank:
    rank, size = 0, 1


def _decisions(detail: dict[str, Any]) -> int:
    return sum(detail["why"].values())


def test_lookup_says_no_only_where_no_next_token_could_be_drafted() -> None:
    rng = random.Random(3)
    for _ in range(2000):
        tokens = [rng.randrange(5) for _ in range(rng.randrange(12))]
        found = any(PromptLookup([*tokens, t]).propose(4) for t in range(6))
        if found:
            assert PromptLookup(tokens).may_find_after_next()
    assert not PromptLookup([1, 2, 3, 4]).may_find_after_next()
    assert PromptLookup([1, 2, 3, 1]).may_find_after_next()  # (1, 2) was seen
    assert PromptLookup([1, 2, 2]).may_find_after_next()  # (2, 2) is indexed next


def test_a_reply_lookup_cannot_draft_asks_once_and_is_computed_ahead() -> None:
    prompt = list(range(10, 40))
    reply = list(range(100, 180))  # never repeats a token: nothing to look up
    out = _decode(prompt, reply, Drafter(prompt))
    detail = out.detail
    # The first step asks (a tree or a draft model might have drafted); the answer
    # says neither is there, and no step asks again: every other one ran ahead.
    assert detail["why"] == {NOTHING: 1}
    assert detail["plain_steps"] == len(reply)
    assert detail["ahead_steps"] == len(reply) - 1
    assert out.drafted == 0


def test_a_tree_or_draft_model_keeps_the_steps_asking() -> None:
    prompt = list(range(10, 40))
    reply = list(range(100, 180))

    class WithModel(Drafter):
        def others_may_draft(self) -> bool:
            return True  # as with --draft-model: lookup alone does not decide

    out = _decode(prompt, reply, WithModel(prompt))
    asked = _decisions(out.detail)
    assert asked > 1  # paused between asks, but asking
    # Every plain step that did not run ahead was a step that asked.
    assert out.detail["plain_steps"] - out.detail["ahead_steps"] == asked


def test_a_quoting_reply_still_drafts_and_keeps_every_decision_accounted() -> None:
    passage = list(range(100, 160))
    prompt = [1, 2, 3, *passage, 4, 5]
    out = _decode(prompt, passage, Drafter(prompt))
    assert out.accepted > len(passage) // 2
    detail = out.detail
    empty = detail["why"].get(NOTHING, 0) + detail["why"].get(NOT_WORTH, 0)
    # Each plain step not computed ahead asked and found nothing, but for the reply's
    # last token after a verify pass (room for no draft, none to compute ahead of).
    assert detail["plain_steps"] - detail["ahead_steps"] == empty + 1


def test_drafts_not_worth_their_pass_stay_quiet_into_the_next_turn() -> None:
    cost = PassCost()
    for _ in range(5):
        for n in (1, 3, 5, 9):
            cost.took(n, 0.4 * (1 + 0.6 * (n - 1)))  # dear: only drafts always kept pay
    tokens = list(range(10)) * 3
    first = Drafter(tokens, cost=cost)
    pauses = []
    for _ in range(3):
        assert first.propose(8) == []
        pauses.append(first.wanted_pause)
    assert pauses == [4, 8, 16]
    second = Drafter(tokens, cost=cost)  # the engine's next turn, the same cost
    assert second.propose(8) == []
    assert second.wanted_pause == 32 == draft_mod.LONGEST_PAUSE


def test_probes_count_the_engines_decisions_so_a_misjudged_cost_is_retried() -> None:
    cost = PassCost()
    for _ in range(5):
        for n in (1, 3, 5, 9):
            cost.took(n, 0.4 * n)
    tokens = list(range(10)) * 3
    whys = []
    for _turn in range(3):  # turns asking 3 times each, fewer than PROBE_EVERY
        drafter = Drafter(tokens, cost=cost)
        for _ in range(3):
            whys.append("probe" if drafter.propose(8) else "quiet")
    assert whys.index("probe") == draft_mod.PROBE_EVERY - 1
    assert cost.quiet == draft_mod.LONGEST_PAUSE
    drafter.advance(8, 3, [1, 2, 3, 4])  # the probe's draft was kept in part
    assert cost.quiet == draft_mod.FIRST_PAUSE  # drafts pay again: ask often


def test_steps_computed_ahead_are_timed_together(monkeypatch) -> None:
    """One step computed ahead can look free after one that waited long: what such
    steps cost is their mean, not the fastest of them."""
    from types import SimpleNamespace

    now = [0.0]
    monkeypatch.setattr(speculate, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    cost = PassCost()
    clock = speculate._StepClock(Drafter([1, 2], cost=cost))
    for i in range(2 * speculate.AHEAD_RUN):
        clock.next_step()
        clock.ran(1, ahead=True)
        now[0] += 1.9 if i % 2 else 0.1  # long, then nearly nothing: a pass each
    clock.next_step()
    clock.ran(5)  # a verify pass, timed alone
    now[0] += 2.0
    clock.next_step()
    assert cost.one is not None and abs(cost.one - 1.0) < 1e-9  # not 0.1
    assert list(cost.times[5]) == [2.0]
