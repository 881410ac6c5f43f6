"""The draft length chooser (issue 46): PassCost learns what a step of 1 + j tokens
costs and Drafter picks the length with the most expected tokens per second.

Pure: fake cost tables and a fake clock stand for this machine's two SmolLM2s (a
float16 pass of 9 tokens costs about 2.2 plain steps, a 4-bit one about 9), so the
policy's choices are checked without a model or a timer.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from exokv.rank import draft as draft_mod
from exokv.rank.draft import (
    BEST,
    NOT_WORTH,
    PROBE,
    UNMEASURED,
    Drafter,
    PassCost,
    expected_tokens,
)
from exokv.rank.speculate import StepAgreement, greedy_accept

ONE = 0.4  # seconds of a plain step


def float16(tokens: int) -> float:
    return ONE * (1 + 0.15 * (tokens - 1))  # 9 tokens: 2.2 plain steps


def four_bit(tokens: int) -> float:
    return ONE * tokens  # each token costs a whole pass


def learnt(table: Callable[[int], float], noise: float = 0.0, seed: int = 0) -> PassCost:
    """A PassCost fed 7 times of each size, each off by up to `noise` (a share)."""
    rng = random.Random(seed)
    cost = PassCost()
    for _ in range(7):
        for n in (1, 3, 5, 9):
            cost.took(n, table(n) * (1 + rng.uniform(-noise, noise)))
    return cost


def test_cheap_long_passes_draft_long_and_costly_ones_not_at_all() -> None:
    assert learnt(float16).worth(8, 0.9) == 8
    assert learnt(float16).worth(8, 0.5) > 0  # still pays, shorter
    assert learnt(four_bit).worth(8, 0.9) == 0
    assert learnt(four_bit).worth(8, 1.0) == 0  # k + 1 tokens for k + 1 steps: no gain
    assert learnt(float16).table()["9"] == 2.2
    assert learnt(four_bit).table()["9"] == 9.0


def test_unmeasured_sizes_are_read_off_a_line_through_the_measured_ones() -> None:
    cost = PassCost()
    cost.took(1, 0.4)
    cost.took(5, 0.64)  # one draft step of 4 timed: 0.06 s a token
    estimate = cost.estimate(9)
    assert estimate is not None and abs(estimate - 0.88) < 1e-9
    assert cost.worth(8, 0.95) == 8  # long passes found cheap without trying one


def test_noisy_times_do_not_flip_the_choice() -> None:
    for seed in range(20):
        # Every time off by up to 25%, and one step in five slowed 3x by a
        # neighbour: the medians still see the same table.
        rng = random.Random(seed)
        fast, slow = PassCost(), PassCost()
        for i in range(40):
            for n in (1, 3, 5, 9):
                spike = 3.0 if rng.random() < 0.2 else 1.0
                fast.took(n, float16(n) * rng.uniform(0.75, 1.25) * spike)
                slow.took(n, four_bit(n) * rng.uniform(0.75, 1.25) * spike)
            if i >= 11:
                assert fast.worth(8, 0.9) >= 4, (seed, i)  # 4 to 8 yield near alike
                assert slow.worth(8, 0.9) == 0, (seed, i)


def test_each_source_has_its_own_acceptance() -> None:
    drafter = Drafter([1, 2, 3, 1, 2], cost=learnt(float16))
    k = drafter.size(room=50)
    assert drafter.propose(k) == [3, 1, 2]
    drafter.advance(3, 0, [9])  # rejected at once
    assert drafter.rate < draft_mod.FIRST_RATE == drafter.model_rate
    for _ in range(10):
        drafter.source = draft_mod.CONVERSATION
        drafter.advance(8, 8, [])
    assert drafter.rate > 0.95  # whole drafts kept: near sure


def test_rank_0s_choice_and_pause_travel_so_every_rank_decides_alike() -> None:
    class Rank1:
        rank, size = 1, 2

        def any_with_values(self, flag: bool, values: list[int]) -> tuple[bool, list[int]]:
            assert values[0] == 0  # rank 1 proposes nothing of its own
            return False, [0, 16, 0, 0, 0, 0]  # rank 0's: no draft, a pause of 16, no tree

    drafter = Drafter([1, 2, 3, 1, 2], cost=learnt(float16))
    stop, got = StepAgreement(Rank1(), None).draft_step(3, drafter)  # type: ignore[arg-type]
    assert (stop, got, drafter.agreed_pause) == (False, [], 16)
    assert drafter.agreed_others is False  # rank 0's word on its tree and draft model
    assert not drafter.why  # no decision of its own
    drafter.advance(0, 0, [4], asked=3)
    assert drafter.length.pause == 16  # rank 0's pause, not its own
    # And the same choices from the same history, whatever the instance.
    a, b = learnt(float16, noise=0.3, seed=5), learnt(float16, noise=0.3, seed=5)
    assert [a.worth(k, r) for k in range(9) for r in (0.2, 0.6, 0.9)] == [
        b.worth(k, r) for k in range(9) for r in (0.2, 0.6, 0.9)
    ]


def dear(tokens: int) -> float:
    return ONE * (1 + 0.6 * (tokens - 1))  # 9 tokens: 5.8 plain steps, worth it only if kept


def test_a_step_not_worth_drafting_pauses_longer_each_time_and_probes_now_and_then() -> None:
    drafter = Drafter(list(range(10)) * 3, cost=learnt(dear))
    pauses, whys = [], []
    for _ in range(draft_mod.PROBE_EVERY):
        drafted = drafter.propose(8)
        whys.append(PROBE if drafted else NOT_WORTH)
        pauses.append(drafter.wanted_pause if not drafted else 0)
    assert whys == [NOT_WORTH] * (draft_mod.PROBE_EVERY - 1) + [PROBE]
    assert pauses[:4] == [4, 8, 16, 32] and max(pauses) == draft_mod.LONGEST_PAUSE
    assert drafter.why == {NOT_WORTH: draft_mod.PROBE_EVERY - 1, PROBE: 1}
    shy = Drafter(list(range(10)) * 3, cost=learnt(dear))
    shy.rate = 0.3  # drafts that fail: not even a probe
    assert not any(shy.propose(8) for _ in range(3 * draft_mod.PROBE_EVERY))
    # Where not even drafts that are always kept would pay, the longest pause at once.
    hopeless = Drafter(list(range(10)) * 3, cost=learnt(four_bit))
    assert hopeless.propose(8) == [] and hopeless.wanted_pause == draft_mod.LONGEST_PAUSE


def test_with_the_prefills_line_alone_a_found_draft_that_could_pay_is_drafted_whole() -> None:
    def untimed(per_token: float, tokens: list[int]) -> Drafter:
        cost = PassCost()
        cost.took(1, ONE)
        cost.prefilled(per_token)
        return Drafter(tokens, cost=cost)

    quoting = list(range(10)) * 2  # the lookup finds the rest of the run
    dear = untimed(0.6 * ONE, quoting)  # not worth at the guessed rate, but if kept
    assert len(dear.propose(8)) == 8 and dear.why == {PROBE: 1}
    hopeless = untimed(ONE, quoting)  # not even a draft always kept would pay
    assert hopeless.propose(8) == [] and hopeless.why == {NOT_WORTH: 1}
    unquoting = untimed(0.6 * ONE, list(range(20)))  # nothing to draft: a pause, as before
    assert unquoting.propose(8) == [] and unquoting.why == {NOT_WORTH: 1}
    assert unquoting.wanted_pause == draft_mod.FIRST_PAUSE
    dear.cost.took(9, 5.8 * ONE)  # once a draft step is timed, its own line decides
    assert dear.propose(8) == [] and dear.why == {PROBE: 1, NOT_WORTH: 1}


def test_no_step_asks_before_a_plain_step_is_timed() -> None:
    cost = PassCost()
    drafter = Drafter(list(range(10)) * 3, cost=cost)
    assert drafter.size(80) == 0 and not drafter.may_find()  # steps stay computed ahead
    cost.took(1, ONE)
    assert drafter.size(80) == draft_mod.MOST and drafter.may_find()
    assert Drafter(list(range(10)) * 3).size(80) == draft_mod.MOST  # no cost: no timing


def test_an_unmeasured_cost_drafts_a_short_draft_to_measure_it() -> None:
    drafter = Drafter(list(range(10)) * 2, cost=PassCost())
    assert len(drafter.propose(8)) == draft_mod.START
    assert drafter.why == {UNMEASURED: 1}


def test_the_prefills_cost_per_token_decides_before_any_draft_is_timed() -> None:
    def first_decision(per_token: float) -> tuple[int, dict]:
        cost = PassCost()
        cost.took(1, ONE)  # a plain step timed, no draft yet
        cost.prefilled(per_token)
        drafter = Drafter(list(range(10)) * 2, cost=cost)
        return len(drafter.propose(8)), dict(drafter.why)

    # 4-bit here: a prefill pass costs a plain step per token, so a draft cannot pay
    assert first_decision(ONE) == (0, {NOT_WORTH: 1})
    # float16: a token of a long pass costs a fraction of a plain step: draft long
    drafted, why = first_decision(0.15 * ONE)
    assert drafted >= 4 and why == {BEST: 1}
    # the prefill's line counts only until a draft step of the model's own is timed
    cost = PassCost()
    cost.took(1, ONE)
    cost.prefilled(ONE)
    cost.took(9, 2.2 * ONE)
    assert cost.table()["9"] == 2.2 and cost.worth(8, 0.9) == 8
    assert not PassCost().known() and PassCost().estimate(2) is None


def simulate(table: Callable[[int], float], reply: list[int], prompt: list[int]) -> float:
    """Decode `reply` after `prompt` with the drafter and a fake clock (each step's time
    off by up to 30%); its tokens/s over plain decoding's."""
    rng = random.Random(1)
    cost = PassCost()
    drafter = Drafter(prompt, cost=cost)
    out: list[int] = []
    clock = 0.0
    while len(out) < len(reply):
        room = len(reply) - len(out)
        k = drafter.size(room)
        draft = drafter.propose(k) if k else []
        drafter.agreed_pause = drafter.wanted_pause
        kept = greedy_accept(draft, reply[len(out) + 0 :])
        new = reply[len(out) : len(out) + kept + 1]
        seconds = table(1 + len(draft)) * rng.uniform(0.7, 1.3)
        cost.took(1 + len(draft), seconds)
        clock += seconds
        drafter.advance(len(draft), kept, new, asked=k)
        out += new
    return (len(reply) / clock) / (1 / table(1))


PASSAGE = list(range(100, 160))  # a 60-token paragraph
FREE = [200 + (i * 37) % 50 for i in range(80)]  # a reply that repeats bits of itself


def test_a_repeated_paragraph_decodes_twice_as_fast_with_cheap_passes_and_never_slower() -> None:
    prompt = [1, 2, 3, *PASSAGE, 4, 5]
    assert simulate(float16, PASSAGE, prompt) >= 2.0
    assert simulate(four_bit, PASSAGE, prompt) >= 0.97
    free_prompt = [1, 2, 3, 4, 5]
    assert simulate(float16, FREE, free_prompt) >= 0.97
    assert simulate(four_bit, FREE, free_prompt) >= 0.97


def test_the_turns_detail_says_why() -> None:
    drafter = Drafter([1, 2, 3, 1, 2], cost=learnt(float16))
    drafter.propose(3)
    drafter.advance(3, 3, [3, 1, 2, 3])
    detail = drafter.detail()
    assert detail["why"] == {BEST: 1}
    assert detail["verify_passes"] == {"3": 1}
    assert detail["pass_cost"]["9"] == 2.2 and detail["plain_step_s"] == ONE
    assert expected_tokens(2, 0.5) == 1.75
