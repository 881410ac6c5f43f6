"""A small model that drafts the reply where the conversation offers nothing (--draft-model).

As mlx-lm's speculative decoding, but across ranks: the draft model is whole (never
sharded) and on rank 0 alone, which proposes every draft and carries it to the other
ranks with the step (exokv.rank.speculate.StepAgreement); they load nothing new. Its
drafts are greedy (its argmax), so a draft is one guess per position, a point mass,
and `point_mass_accept` keeps the target's distribution exact at temperature > 0;
drawing nothing at random, it also leaves rank 0's random state as every other
rank's.

The draft model keeps its own KV cache of the tokens it has run. A proposal first
trims that cache back to where it agrees with the turn's tokens (a rejected draft's
tail, or a new turn's first difference), runs what it lacks (a new prompt, the
accepted tokens), then runs its own guesses. The cache outlives the turn: a
conversation's next turn shares all of its earlier turns, so only the new message is
run again. It is not in the cache budget (one small model's tokens, rank 0 only).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

from exokv.errors import ExokvError, UsageError
from exokv.model.loading import load_tokenizer
from exokv.model.resolve import load_model, resolve_model

CATCH_UP_STEP = 512  # tokens a catch-up (a new prompt) runs at a time
WEIGHT = 0.3  # of a new measurement in the running cost
SAMPLE = "Hello, world! 1234 The quick brown fox: über naïve café — <|im_end|>\n\tdef f(x):"


def same_tokenizer(target: Any, draft: Any) -> bool:
    """Whether an id means the same token to `draft` as to `target`: the same vocabulary
    (token to id, its size with it), where both list theirs; else the same ids for a
    sample text. The draft model reads and writes ids only, never text, so the way
    each splits text into tokens (a family's own pre-tokenizer) does not matter."""
    lists = getattr(target, "get_vocab", None), getattr(draft, "get_vocab", None)
    if lists[0] is not None and lists[1] is not None:
        try:
            return bool(lists[0]() == lists[1]())
        except (NotImplementedError, AttributeError, TypeError):
            pass  # a tokenizer that lists no vocabulary: the sample decides
    try:
        return list(target.encode(SAMPLE)) == list(draft.encode(SAMPLE))
    except Exception:  # noqa: BLE001 - a tokenizer that cannot spell the sample differs
        return False


def check_draft(name: str, target_tokenizer: Any, draft_tokenizer: Any, cache: list[Any]) -> None:
    """One line (UsageError) for a draft model that cannot draft for the target."""
    if not same_tokenizer(target_tokenizer, draft_tokenizer):
        raise UsageError(f"--draft-model {name}: its tokenizer differs from the model's")
    if not can_trim_prompt_cache(cache):
        raise UsageError(
            f"--draft-model {name}: its cache cannot be trimmed (sliding-window or recurrent "
            "layers): choose a model with full attention only"
        )


def load_draft(name: str, target_tokenizer: Any) -> DraftModel:
    """--draft-model `name`, loaded whole (the same resolver as --model) and checked."""
    try:
        model, tokenizer = load_model(name)
    except ExokvError as err:  # an unknown name as a bad --model's: one line, exit 2
        raise UsageError(f"--draft-model: {err}") from None
    draft = DraftModel(model, name)
    check_draft(name, target_tokenizer, tokenizer, draft.cache)
    return draft


def check_names(model: str, draft: str) -> None:
    """Before the ranks start: `draft` is a model and spells text as `model` does (its
    tokenizer's files only, no weights; rank 0 loads the weights)."""
    try:
        draft_path = resolve_model(draft)
        draft_tokenizer = load_tokenizer(draft_path)[0]
    except ExokvError as err:
        raise UsageError(f"--draft-model: {err}") from None
    if not same_tokenizer(load_tokenizer(resolve_model(model))[0], draft_tokenizer):
        raise UsageError(f"--draft-model {draft}: its tokenizer differs from the model's")


class DraftModel:
    """The draft source `exokv.rank.draft.Drafter` asks when the conversation has no draft."""

    def __init__(self, model: Any, name: str = "") -> None:
        self.model = model
        self.name = name
        self.cache = make_prompt_cache(model)
        self.held: list[int] = []  # the tokens self.cache has run, in order
        self.seconds: float | None = None  # one draft token's cost: a forward pass here

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """The draft model's greedy `k` tokens after `tokens`."""
        if k <= 0 or not tokens:
            return []
        keep = 0
        most = min(len(self.held), len(tokens) - 1)  # the last token runs: its logits
        while keep < most and self.held[keep] == tokens[keep]:
            keep += 1
        trim_prompt_cache(self.cache, len(self.held) - keep)
        self.held = list(tokens[:keep])
        pending = list(tokens[keep:])
        if len(pending) > CATCH_UP_STEP // 8:  # a prompt: run it in steps, out of the timing
            for at in range(0, len(pending) - 1, CATCH_UP_STEP):
                piece = pending[at : min(at + CATCH_UP_STEP, len(pending) - 1)]
                self.model(mx.array(piece)[None], cache=self.cache)
                mx.eval([c.state for c in self.cache])
            self.held += pending[:-1]
            pending = pending[-1:]
        tic = time.perf_counter()
        # Each guess is the next pass's input without a wait: one evaluation for all k.
        guesses: list[mx.array] = []
        step = mx.array(pending)[None]
        for _ in range(k):
            logits = self.model(step, cache=self.cache)[0, -1]
            guess = mx.argmax(logits)
            guesses.append(guess)
            step = guess.reshape(1, 1)
        mx.eval(guesses, [c.state for c in self.cache])
        out = [int(g.item()) for g in guesses]
        self.held += pending + out[:-1]  # the last guess is not run yet
        took = (time.perf_counter() - tic) / k
        self.seconds = took if self.seconds is None else (1 - WEIGHT) * self.seconds + WEIGHT * took
        return out
