"""--draft-model (issue 33): a small model on rank 0 drafts where the conversation has none.

Its drafts are greedy and checked by the target like any other, so replies equal
plain decoding's at temperature 0 whatever the draft model is; a draft model that is
the target itself drafts every token right. One with another vocabulary is refused
before any turn, in one line.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from chat_helpers import home_with_models, run_exokv

from exokv.core.records import TurnRequest
from exokv.errors import UsageError
from exokv.rank.draft import MODEL, Drafter, PassCost
from exokv.rank.draft_model import DraftModel, check_draft, same_tokenizer
from exokv.rank.engine import Engine

QUESTION = [{"role": "user", "content": "Hello there, tell me about the weather in Paris today"}]
PROMPT = QUESTION[0]["content"]


class Guesses:
    """A draft model's stand-in: always the same guesses, at a given cost."""

    def __init__(self, seconds: float | None = None) -> None:
        self.seconds = seconds
        self.asked: list[int] = []

    def propose(self, tokens: Any, k: int) -> list[int]:
        self.asked.append(k)
        return [7] * k


def test_the_model_drafts_only_where_the_conversation_has_nothing() -> None:
    source = Guesses()
    drafter = Drafter([1, 2, 3, 1, 2], model=source)
    assert drafter.propose(2) == [3, 1]  # prompt lookup first
    assert source.asked == []
    drafter.advance(2, 2, [3, 1, 9])
    assert drafter.propose(3) == [7, 7, 7]  # [1, 9] is new: the model's guess
    assert (drafter.source, drafter.model_drafted) == (MODEL, 3)
    drafter.advance(3, 0, [5])
    assert drafter.model_rate < 0.8 < drafter.rate  # each source's own acceptance


def test_the_draft_models_time_is_in_what_a_draft_is_worth() -> None:
    unmeasured = Guesses(seconds=0.001)
    assert Drafter([1, 2, 3], cost=PassCost(), model=unmeasured).propose(4) == []
    assert unmeasured.asked == []  # a plain step first, which measures a pass
    cost = PassCost()
    cost.took(1, 0.10)
    cost.took(5, 0.14)  # a verify pass's extra tokens are cheap (a GPU)
    assert cost.worth(8, 0.9) == 8
    assert cost.worth(8, 0.9, drafting=0.1) == 0  # each guess costs a whole pass: no gain
    slow = Guesses(seconds=0.1)
    drafter = Drafter([1, 2, 3], cost=cost, model=slow)
    assert drafter.propose(4) == [] and slow.asked == []  # not worth proposing at all
    fast = Guesses(seconds=0.001)
    assert Drafter([1, 2, 3], cost=cost, model=fast).propose(4) == [7] * 4


def test_the_draft_model_guesses_its_greedy_tokens_and_keeps_its_cache_in_step(tiny) -> None:
    from exokv.cache import kinds

    model, tokenizer = tiny
    plain = Engine(model, tokenizer)
    request = TurnRequest(session="s", messages=QUESTION, max_tokens=12, speculate=False)
    reply = plain.reply_tokens(plain.turn(request).reply)
    assert reply and len(reply) >= 8
    tokens = plain.render(QUESTION)
    draft = DraftModel(model)
    assert draft.propose(tokens, 4) == reply[:4]
    assert kinds.offset(draft.cache) == len(draft.held) == len(tokens) + 3
    # Two kept and the target's own token differs: the cache goes back to what agrees.
    after = [*tokens, *reply[:2], reply[2] + 1]
    guess = draft.propose(after, 2)
    assert len(guess) == 2
    assert kinds.offset(draft.cache) == len(draft.held) == len(after) + 1
    assert draft.propose([*tokens, *reply[:5]], 3) == reply[5:8]
    assert draft.seconds is not None and draft.seconds > 0


def test_drafting_draws_nothing_at_random(tiny) -> None:
    # Only rank 0 drafts: a draw there would put its sampling out of step with the
    # other ranks' at temperature > 0.
    import mlx.core as mx

    model, tokenizer = tiny
    tokens = Engine(model, tokenizer).render(QUESTION)
    mx.random.seed(11)
    alone = mx.random.uniform(shape=(4,)).tolist()
    mx.random.seed(11)
    assert len(DraftModel(model).propose(tokens, 4)) == 4
    assert mx.random.uniform(shape=(4,)).tolist() == alone


def test_a_draft_model_that_is_the_model_drafts_every_token_right(tiny) -> None:
    model, tokenizer = tiny
    plain = Engine(model, tokenizer)
    spec = Engine(model, tokenizer, draft=DraftModel(model))
    spec.pass_cost = None  # the drafts' lengths by the policy alone, not this CPU's load
    follow, reply = [*QUESTION], ""
    for message in ("", "And tomorrow?"):  # the second turn: its cache runs the new part
        if message:
            follow += [{"role": "assistant", "content": reply}]
            follow += [{"role": "user", "content": message}]
        request = TurnRequest(session="s", messages=follow, max_tokens=24, use_cache=False)
        request.speculate = False
        want = plain.turn(request)
        request.speculate = True
        got = spec.turn(request)
        assert got.reply == want.reply
        reply = got.reply
        # Every model draft is kept whole (the conversation drafts first, and may miss).
        assert got.accepted_tokens >= got.model_draft_tokens > got.generated_tokens // 2
        if not message:  # the first reply repeats nothing of the prompt: the model's alone
            assert got.accepted_tokens == got.draft_tokens == got.model_draft_tokens


def test_a_tokenizer_with_other_ids_is_refused(tiny, models_dir: Path, tmp_path: Path) -> None:
    from exokv.model.loading import load_tokenizer

    model, tokenizer = tiny
    other = _other_vocabulary(models_dir / "tiny", tmp_path / "other")
    assert same_tokenizer(tokenizer, load_tokenizer(models_dir / "tiny")[0])
    assert not same_tokenizer(tokenizer, load_tokenizer(other)[0])
    with pytest.raises(UsageError, match="its tokenizer differs from the model's"):
        check_draft(str(other), tokenizer, load_tokenizer(other)[0], DraftModel(model).cache)


def _other_vocabulary(tiny_dir: Path, out: Path) -> Path:
    """builtin:tiny with two of its tokens' ids swapped: the same size, other ids."""
    shutil.copytree(tiny_dir, out)
    path = out / "tokenizer.json"
    doc = json.loads(path.read_text())
    vocab = doc["model"]["vocab"]
    a, b = (next(t for t, i in vocab.items() if i == n) for n in (500, 501))
    vocab[a], vocab[b] = vocab[b], vocab[a]
    path.write_text(json.dumps(doc))
    return out


def _turn(proc: Any) -> dict[str, Any]:
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    return json.loads(proc.stdout.decode().splitlines()[0])


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_chat_drafts_with_the_draft_model_and_refuses_a_bad_one(
    tiny, models_dir: Path, tmp_path: Path
) -> None:
    home = home_with_models(tmp_path / "home", models_dir, link=True)
    args = ["chat", "--model", "builtin:tiny", "--json", "--max-tokens", "24", "--no-cache"]
    plain = _turn(run_exokv([*args, "--no-speculate", PROMPT], home))
    spec = _turn(run_exokv([*args, "--draft-model", "builtin:tiny", PROMPT], home))
    assert spec["reply"] == plain["reply"]
    # The conversation may draft too (as the pass timings allow): the model must have.
    assert spec["accepted_tokens"] > 0 and spec["model_draft_tokens"] > 0
    # Why it drafted so: rank 0's draft decisions, its passes by length, the cost.
    detail = spec["speculation_detail"]
    assert sum(detail["why"].values()) >= sum(detail["verify_passes"].values()) > 0
    assert detail["acceptance"]["model"] > 0 and plain["speculation_detail"] == {}
    other = _other_vocabulary(models_dir / "tiny", tmp_path / "other")
    for bad, says in [
        (["--draft-model", str(other)], "its tokenizer differs from the model's"),
        (["--draft-model", "builtin:nope"], "--draft-model: model 'builtin:nope' not found"),
        (["--draft-model", "builtin:tiny", "--no-speculate"], "not with --no-speculate"),
    ]:
        proc = run_exokv([*args, *bad, PROMPT], home)
        err = proc.stderr.decode().strip()
        assert proc.returncode == 2, err
        assert says in err and len(err.splitlines()) == 1 and not proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_pipeline_ranks_check_rank_0s_model_drafts(
    tiny, models_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from exokv.model.resolve import resolve_model

    home = home_with_models(tmp_path / "home", models_dir)
    with monkeypatch.context() as env:
        env.setenv("EXOKV_HOME", str(home))
        resolve_model("builtin:llama-tiny")  # another model, the same tokenizer
    model, tokenizer = tiny
    want = Engine(model, tokenizer).turn(
        TurnRequest(session="s", messages=QUESTION, max_tokens=24, speculate=False)
    )
    args = ["chat", "--model", "builtin:tiny", "--json", "--max-tokens", "24", "--no-cache"]
    ranks = ["-n", "2", "--parallel", "pipeline", "--starting-port", "27500"]
    got = _turn(run_exokv([*args, *ranks, "--draft-model", "builtin:llama-tiny", PROMPT], home))
    assert got["reply"] == want.reply
    assert got["model_draft_tokens"] > 0
