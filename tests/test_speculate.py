"""Speculative decoding (issue 33): drafts from the turn's tokens, verified k at a time.

The draft source and its length policy are pure (exokv.rank.draft); the verify step
(exokv.rank.speculate) must give the reply plain decoding gives at temperature 0,
and keep the target distribution above it. Random-weight models rarely repeat text,
so the verify path is also driven by a scripted draft source that is partly wrong.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from chat_helpers import home_with_models, run_exokv

from exokv.cache import kinds
from exokv.core.records import TurnRequest
from exokv.rank import draft as draft_mod
from exokv.rank.draft import Drafter, DraftLength, PromptLookup, ScriptedDrafter
from exokv.rank.engine import Engine, EngineOptions
from exokv.rank.speculate import greedy_accept, point_mass_accept

QUESTION = [{"role": "user", "content": "Hello there, tell me about the weather in Paris today"}]

# -- the draft source -------------------------------------------------------------------


def test_lookup_proposes_what_followed_the_tail_earlier() -> None:
    lookup = PromptLookup([5, 6, 7, 8, 9, 1, 2, 5, 6])
    assert lookup.propose(3) == [7, 8, 9]
    assert lookup.propose(10) == [7, 8, 9, 1, 2, 5, 6]  # up to the end of the tokens
    assert lookup.propose(0) == []
    lookup.extend([4])  # the tail [5, 6, 4] was never seen: no draft
    assert lookup.propose(3) == []


def test_lookup_prefers_the_longest_tail_and_never_matches_itself() -> None:
    # [2, 3] last came before 9, but [1, 2, 3] came before 7: the longer tail wins.
    lookup = PromptLookup([1, 2, 3, 7, 0, 2, 3, 9, 1, 2, 3])
    assert lookup.propose(1) == [7]
    # A tail seen only as the tail itself has no continuation.
    assert PromptLookup([4, 5]).propose(2) == []


def test_draft_length_caps_and_pauses_while_drafts_fail() -> None:
    length = DraftLength(most=8)
    assert length.next(room=100) == 8  # the cap: rank 0's cost model chooses below it
    length.record(8, 2)
    assert length.next(100) == 8  # a partly kept draft does not shrink the cap
    assert length.next(room=2) == 1  # the verify pass's own token needs room too
    assert length.next(room=1) == 0
    for _ in range(draft_mod.MISSES):
        length.record(1, 0)
    assert length.next(100) == 0  # paused
    length.decoded(draft_mod.FIRST_PAUSE - 1)
    assert length.next(100) == 0
    length.decoded(1)
    assert length.next(100) == 8
    for _ in range(draft_mod.MISSES):
        length.record(1, 0)
    length.decoded(draft_mod.FIRST_PAUSE)
    assert length.next(100) == 0  # the second pause is twice as long
    length.decoded(draft_mod.FIRST_PAUSE)
    assert length.next(100) == 8
    length.record(1, 1)  # an accepted token ends the pauses
    assert length.next_pause == draft_mod.FIRST_PAUSE
    length.pause_for(10)  # what rank 0 asked after an empty draft
    length.decoded(9)
    assert length.next(100) == 0
    length.decoded(1)
    assert length.next(100) == 8


def test_a_draft_is_as_long_as_its_pass_pays() -> None:
    from exokv.rank.draft import PassCost

    cost = PassCost()
    assert cost.worth(5, 0.1) == 5  # not measured yet: draft, which measures it
    cost.took(1, 0.10)
    cost.took(5, 0.14)  # a GPU: four more tokens cost 40 ms
    assert cost.worth(8, 0.9) == 8
    assert cost.worth(8, 0.0) == 0  # nothing kept: no draft pays
    cpu = PassCost()
    cpu.took(1, 0.10)
    cpu.took(5, 0.50)  # a busy CPU: each token costs as much as the first
    assert cpu.worth(8, 0.6) == 0
    assert cpu.worth(8, 1.0) == 0  # k + 1 tokens for k + 1 passes' time: even
    for _ in range(20):
        cpu.took(5, 0.30)  # half a token's cost each: a few drafted tokens pay, not 8
    assert 0 < cpu.worth(8, 0.95) < 8
    drafter = Drafter([1, 2, 3, 1, 2], cost=cpu)
    drafter.rate = 0.1
    assert drafter.propose(3) == []  # cut to nothing on rank 0, which sends no draft


def test_a_draft_step_with_nothing_to_draft_pauses_briefly() -> None:
    drafter = Drafter([1, 2, 3])
    k = drafter.size(room=50)
    assert drafter.propose(k) == []
    drafter.advance(0, 0, [4], asked=k)
    assert drafter.size(50) == 0  # paused: the next steps are plain
    drafter.advance(0, 0, [5] * (draft_mod.FIRST_PAUSE - 1))
    assert drafter.size(50) == 0
    drafter.advance(0, 0, [6])
    assert drafter.size(50) == k


def test_drafter_follows_the_reply_as_it_grows() -> None:
    drafter = Drafter([10, 11, 12, 13, 14, 10, 11])
    k = drafter.size(room=50)
    assert drafter.propose(k) == [12, 13, 14, 10, 11][:k]
    drafter.advance(k, 2, [12, 13, 99])
    assert drafter.propose(4) == []  # [13, 99] is new
    assert drafter.lookup.tokens[-3:] == [12, 13, 99]


# The chi-square statistic's 0.999 quantile at 5 degrees of freedom (6 outcomes).
CHI2_5_999 = 20.515


def chi_square(observed: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * observed.sum()
    return float(((observed - expected) ** 2 / expected).sum())


def _tree(*paths: list[int]) -> Any:
    from exokv.cache.radix import RadixTree

    tree = RadixTree()
    for path in paths:
        tree.insert(path, lambda a, b: None, lambda payload, k: (None, None))
    return tree


def test_the_tree_drafts_what_it_stored_after_this_context() -> None:
    from exokv.rank.draft import TreeContinuation

    tree = _tree([1, 2, 3, 4, 5, 6], [1, 2, 3, 9, 9])  # the second one used last
    cursor = TreeContinuation(tree, [1, 2])
    assert cursor.propose(3) == [3, 9, 9]  # the branch used last
    cursor.extend([3, 4])
    assert cursor.propose(5) == [5, 6]
    cursor.extend([5, 7])  # off the stored path: nothing more
    assert cursor.propose(2) == []
    assert TreeContinuation(tree, [1, 8]).propose(2) == []
    # The tree's continuation comes before prompt lookup's.
    drafter = Drafter([1, 2], tree=tree)
    assert drafter.propose(2) == [3, 9]
    assert Drafter([7, 8, 7, 8], tree=tree).propose(2) == [7, 8]


# -- accepting drafts -------------------------------------------------------------------


def test_greedy_accept_keeps_the_agreeing_prefix() -> None:
    assert greedy_accept([1, 2, 3], [1, 2, 3, 4]) == 3
    assert greedy_accept([1, 2, 3], [1, 5, 3, 4]) == 1
    assert greedy_accept([1], [2, 0]) == 0
    assert greedy_accept([], [7]) == 0


def test_speculative_sampling_follows_the_target_distribution() -> None:
    # A toy vocabulary of 6: the first token out of a verify pass (the draft's first
    # token, kept with probability p(d), else a draw from the residual) must follow
    # p; and so must the second, given the first was the draft's.
    rng = np.random.default_rng(1234)
    p0 = np.array([0.05, 0.30, 0.10, 0.25, 0.20, 0.10])
    p1 = np.array([0.40, 0.05, 0.05, 0.20, 0.10, 0.20])
    p2 = np.array([0.10, 0.10, 0.10, 0.10, 0.10, 0.50])
    probs = np.stack([p0, p1, p2])
    draft = [3, 0]
    n = 20000
    first = np.zeros(6)
    second = np.zeros(6)
    for _ in range(n):
        kept, token = point_mass_accept(probs, draft, rng.random(2 * len(draft) + 1).tolist())
        out = [*draft[:kept], token]
        first[out[0]] += 1
        if kept >= 1:
            second[out[1]] += 1
    assert chi_square(first, p0) < CHI2_5_999
    assert chi_square(second, p1) < CHI2_5_999
    # And the test can fail: keeping the draft's token without the residual draw
    # (a rejection sampled from p itself) over-weights the draft token.
    biased = np.zeros(6)
    for _ in range(n):
        u = rng.random(2)
        biased[3 if u[0] < p0[3] else int(np.searchsorted(np.cumsum(p0), u[1]))] += 1
    assert chi_square(biased, p0) > CHI2_5_999


def test_a_sure_draft_is_always_kept_and_an_impossible_one_never() -> None:
    probs = np.array([[0.0, 1.0, 0.0], [0.5, 0.0, 0.5]])
    assert point_mass_accept(probs, [1], [0.999, 0.5, 0.1]) == (1, 0)
    kept, token = point_mass_accept(probs, [2], [0.0, 0.99, 0.1])
    assert (kept, token) == (0, 1)


# -- the engine: replies as plain decoding's ------------------------------------------------


def _load(home: Path, name: str) -> Any:
    from exokv.model.resolve import load_model

    old = os.environ.get("EXOKV_HOME")
    os.environ["EXOKV_HOME"] = str(home)
    try:
        return load_model(name)
    finally:
        if old is None:
            del os.environ["EXOKV_HOME"]
        else:
            os.environ["EXOKV_HOME"] = old


@pytest.fixture(scope="module")
def zoo_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("spec-zoo")


def _scripted(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tokens: list[int]) -> None:
    path = tmp_path / "drafts.json"
    path.write_text(json.dumps(tokens))
    monkeypatch.setenv("EXOKV_TEST_DRAFTS", str(path))


@pytest.mark.parametrize("name", ["builtin:tiny", "builtin:llama-tiny", "builtin:qwen3-tiny"])
def test_partly_wrong_drafts_give_the_plain_reply_and_cache(
    name: str, tiny, zoo_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, tokenizer = tiny if name == "builtin:tiny" else _load(zoo_home, name)
    plain = Engine(model, tokenizer)
    request = TurnRequest(session="s", messages=QUESTION, max_tokens=30, speculate=False)
    want = plain.turn(request)
    reply = plain.reply_tokens(want.reply)
    assert reply
    _scripted(monkeypatch, tmp_path, reply)
    spec = Engine(model, tokenizer)
    request.speculate = True
    got = spec.turn(request)
    assert spec.speculation == ""
    assert got.reply == want.reply
    assert got.generated_tokens == want.generated_tokens
    # Every third draft token is wrong: some drafted tokens kept, some not.
    assert 0 < got.accepted_tokens < got.draft_tokens
    # The next turn finds the same cached prefix: rejected positions left no trace.
    follow = [*QUESTION, {"role": "assistant", "content": want.reply}]
    follow.append({"role": "user", "content": "And tomorrow?"})
    again = [e.turn(TurnRequest(session="s", messages=follow, max_tokens=8)) for e in (plain, spec)]
    assert again[0].cached_tokens == again[1].cached_tokens > want.prompt_tokens
    assert again[0].reply == again[1].reply


def test_a_retry_is_drafted_from_the_tree_whole(tiny) -> None:
    model, tokenizer = tiny
    engine = Engine(model, tokenizer)
    engine.pass_cost = None  # the drafts' lengths by the policy alone, not this CPU's load
    request = TurnRequest(session="s", messages=QUESTION, max_tokens=30, speculate=False)
    first = engine.turn(request)
    request.speculate = True
    again = engine.turn(request)  # /retry at temperature 0: the same messages
    assert again.reply == first.reply
    assert again.cached_tokens == first.prompt_tokens - 1
    # Every draft was the stored reply and kept whole: 30 tokens in 4 passes
    # (drafts of 4, 6, 8 and 8 tokens, each pass adding its own token).
    assert again.accepted_tokens == again.draft_tokens == 26
    assert again.generated_tokens - again.accepted_tokens == 4


def test_the_cache_holds_exactly_the_turn_after_a_verify(tiny, tmp_path, monkeypatch) -> None:
    from exokv.rank import speculate

    model, tokenizer = tiny
    engine = Engine(model, tokenizer)
    tokens = engine.render(QUESTION)
    cache = engine._new_cache()
    from exokv.rank.engine import prefill

    prefill(model, cache, tokens[:-1])
    steps = speculate.StepAgreement(engine.group, None)
    drafter = ScriptedDrafter(tokens, list(range(40, 80)))
    out = speculate.decode(model, tokenizer, tokens[-1], cache, 12, 0.0, drafter, steps)
    assert out.drafted > 0
    assert kinds.offset(cache) == len(tokens) + len(out.tokens)


def test_sliding_window_families_decode_plainly_and_say_why(zoo_home: Path) -> None:
    model, tokenizer = _load(zoo_home, "builtin:gemma3-tiny")
    engine = Engine(model, tokenizer)
    result = engine.turn(TurnRequest(session="s", messages=QUESTION, max_tokens=6))
    assert result.draft_tokens == 0
    assert "rotating window" in engine.speculation
    assert result.speculation == engine.speculation


def test_max_kv_size_turns_speculation_off(tiny) -> None:
    model, tokenizer = tiny
    engine = Engine(model, tokenizer, options=EngineOptions(max_kv_size=64))
    result = engine.turn(TurnRequest(session="s", messages=QUESTION, max_tokens=4))
    assert "cannot be trimmed" in result.speculation


def test_no_speculate_is_stated(tiny) -> None:
    model, tokenizer = tiny
    engine = Engine(model, tokenizer)
    result = engine.turn(TurnRequest(session="s", messages=QUESTION, max_tokens=4, speculate=False))
    assert (result.speculation, result.draft_tokens) == ("off", 0)


def test_temperature_above_zero_with_drafts_is_seeded_alike(tiny, tmp_path, monkeypatch) -> None:
    model, tokenizer = tiny
    plain = Engine(model, tokenizer)
    reply = plain.reply_tokens(
        plain.turn(TurnRequest(session="s", messages=QUESTION, max_tokens=20)).reply
    )
    _scripted(monkeypatch, tmp_path, reply or [1, 2, 3])
    import mlx.core as mx

    runs = []
    for _ in range(2):
        engine = Engine(model, tokenizer)
        mx.random.seed(7)  # as the chat's --seed seeds each rank once
        request = TurnRequest(session="s", messages=QUESTION, max_tokens=20, temp=0.8)
        runs.append(engine.turn(request))
    assert runs[0].reply == runs[1].reply
    assert runs[0].draft_tokens > 0
    assert runs[0].generated_tokens == 20 or runs[0].finish_reason == "stop"
    # A request's own seed (exokv serve's) must repeat whatever the cache could draft.
    seeded = TurnRequest(session="s", messages=QUESTION, max_tokens=8, temp=0.8, sample_seed=7)
    result = Engine(model, tokenizer).turn(seeded)
    assert result.draft_tokens == 0 and "seeded" in result.speculation


# -- through the chat, on one rank and two pipeline ranks -------------------------------------


def _turns(proc: Any) -> list[dict[str, Any]]:
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    docs = [json.loads(line) for line in proc.stdout.decode().splitlines() if line.strip()]
    return [d for d in docs if "turn" in d]


SCRIPT = "Hello there, tell me about the weather in Paris today\n/retry\nAnd tomorrow?\n"


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("name", "port"), [("builtin:tiny", "26133"), ("builtin:llama-tiny", "26143")]
)
def test_two_pipeline_ranks_verify_rank_0s_drafts(
    name: str, port: str, models_dir: Path, zoo_home: Path, tmp_path: Path
) -> None:
    models = models_dir
    if name != "builtin:tiny":
        _load(zoo_home, name)  # generated into zoo_home/models
        models = zoo_home / "models"
    home = home_with_models(tmp_path / "home", models, link=True)
    # Each run starts cold: the disk tier is read by any split, so the two ranks would
    # find the plain run's cache in its home.
    spec_home = home_with_models(tmp_path / "spec-home", models, link=True)
    args = ["chat", "--model", name, "--json", "--max-tokens", "24"]
    plain = _turns(run_exokv([*args, "--no-speculate"], home, SCRIPT))
    assert all(t["draft_tokens"] == 0 == t["accepted_tokens"] for t in plain)
    # Rank 0 drafts from the first reply's tokens (partly wrong); rank 1 reads none.
    model, tokenizer = _load(home, name)
    engine = Engine(model, tokenizer)
    first = engine.turn(TurnRequest(session="s", messages=QUESTION, max_tokens=24))
    assert first.reply == plain[0]["reply"]
    drafts = tmp_path / "drafts.json"
    drafts.write_text(json.dumps(engine.reply_tokens(first.reply)))
    ranks = ["-n", "2", "--parallel", "pipeline", "--starting-port", port]
    env = {"EXOKV_TEST_DRAFTS": str(drafts)}
    spec = _turns(run_exokv([*args, *ranks], spec_home, SCRIPT, env=env))
    assert [t["reply"] for t in spec] == [t["reply"] for t in plain]
    assert [t["cached_tokens"] for t in spec] == [t["cached_tokens"] for t in plain]
    assert 0 < spec[0]["accepted_tokens"] < spec[0]["draft_tokens"]
    # Rank 0's account of the turn's passes reaches the front end.
    passes = spec[0]["speculation_detail"]["verify_passes"]
    assert sum(int(n) * c for n, c in passes.items()) == spec[0]["draft_tokens"]


@pytest.mark.slow
def test_stats_show_the_acceptance_rate(tiny, models_dir: Path, tmp_path: Path) -> None:
    home = home_with_models(tmp_path / "home", models_dir, link=True)
    model, tokenizer = tiny
    engine = Engine(model, tokenizer)
    first = engine.turn(TurnRequest(session="s", messages=QUESTION, max_tokens=24))
    drafts = tmp_path / "drafts.json"
    drafts.write_text(json.dumps(engine.reply_tokens(first.reply)))
    args = ["chat", "--model", "builtin:tiny", "--json", "--max-tokens", "24"]
    env = {"EXOKV_TEST_DRAFTS": str(drafts)}
    proc = run_exokv(args, home, QUESTION[0]["content"] + "\n/stats\n", env=env)
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    docs = [json.loads(line) for line in proc.stdout.decode().splitlines() if line.strip()]
    turn, stats = docs[0], docs[1]["data"][0]
    assert turn["reply"] == first.reply
    assert 0 < turn["accepted_tokens"] < turn["draft_tokens"]
    assert stats["draft_tokens"] == turn["draft_tokens"]
    assert stats["acceptance_rate"] == round(turn["accepted_tokens"] / turn["draft_tokens"], 4)
    cache = run_exokv(["cache", "stats", "--json"], home)
    total = json.loads(cache.stdout)["total"]
    assert (total["draft_tokens"], total["accepted_tokens"]) == (
        turn["draft_tokens"],
        turn["accepted_tokens"],
    )
    text = run_exokv(["cache", "stats"], home, env={"COLUMNS": "120"}).stdout.decode()
    rate = f"{100 * turn['accepted_tokens'] / turn['draft_tokens']:.0f}%"
    assert f"{turn['accepted_tokens']} of {turn['draft_tokens']} drafted kept ({rate})" in text


# -- the decode's rate with drafts (issue 45) ----------------------------------------------


class _PassClock:
    """A model whose every forward pass takes one second of a fake clock."""

    def __init__(self, model: Any) -> None:
        self.model, self.now, self.passes = model, 0.0, 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.now += 1.0
        self.passes += 1
        return self.model(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)

    def perf_counter(self) -> float:
        return self.now


class _RightDrafter(ScriptedDrafter):
    """Drafts the reply itself: every draft token is kept."""

    def propose(self, k: int) -> list[int]:
        at = len(self.lookup.tokens) - self.prompt
        return self.script[at : at + k]


@pytest.mark.parametrize(
    ("max_tokens", "drafts"), [(4, _RightDrafter), (12, ScriptedDrafter)], ids=["right", "partly"]
)
def test_decode_tps_is_the_tokens_over_the_decodes_time(
    tiny, monkeypatch: pytest.MonkeyPatch, max_tokens: int, drafts: type[ScriptedDrafter]
) -> None:
    """Tokens a verify pass keeps arrive at once: the rate is every generated token
    over the decode's passes, not the tokens after the first over almost no time."""
    from types import SimpleNamespace

    from exokv.rank import speculate
    from exokv.rank.engine import prefill

    model, tokenizer = tiny
    engine = Engine(model, tokenizer)
    plain = engine.turn(TurnRequest(session="p", messages=QUESTION, max_tokens=max_tokens))
    reply = engine.reply_tokens(plain.reply)
    tokens = engine.render(QUESTION)
    cache = engine._new_cache()
    prefill(model, cache, tokens[:-1])
    clock = _PassClock(model)
    monkeypatch.setattr(speculate, "time", SimpleNamespace(perf_counter=clock.perf_counter))
    steps = speculate.StepAgreement(engine.group, None)
    drafter = drafts(tokens, reply, most=8)
    out = speculate.decode(clock, tokenizer, tokens[-1], cache, max_tokens, 0.0, drafter, steps)
    assert out.accepted > 0  # some passes gave several tokens
    n, passes = len(out.tokens), clock.passes
    assert n > passes
    # A last pass may only run the last token into the cache, after the reply is timed.
    assert n / passes <= out.tps <= n / (passes - 1)
