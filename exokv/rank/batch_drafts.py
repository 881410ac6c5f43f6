"""Drafts for a batch's rows, verified in the batch's one forward pass (issue 46).

Each row of a batch (exokv.rank.batch) that may speculate has its own drafter: prompt
lookup in the row's own prompt and reply (exokv.rank.draft, as a lone turn's), and its
own draft length. At a step where some row has a draft, the step runs every row's
token and draft as one pass of the batch, the shorter drafts padded (a row without a
draft contributes its one token): rows x (1 + the longest draft) tokens. Each row keeps
what its own check keeps (exokv.rank.speculate: the model's argmax at temperature 0,
so a reply is the plain batch's; `point_mass_accept` above 0, so its distribution
is), and the positions it did not keep come off its cache alone (`trim_rows`).

A step with a draft waits for the step before it: the drafts follow the tokens it
gave. A step where no row wants to draft (each drafter paused, or nothing to look
up) is the plain one, queued ahead as ever.

Whether drafting pays is measured, not assumed (`Switch`): rank 0 times the steps
with drafts and the plain ones, in tokens per second, and drafting stays on while
its steps give more (on this machine's CPU a pass of k tokens per row costs nearly k
passes of one, so they rarely do; on a GPU a pass of a few tokens costs about one).
Off, a step with drafts is tried again every PROBE_EVERY steps.

Every rank decides alike: the drafts come from the rows' tokens, which every rank
holds; the lengths from how the drafts fared, which every rank computes from the
same logits (and, above temperature 0, the same random draws: the ranks are seeded
alike); the switch is rank 0's, carried in the step's one gather
(exokv.rank.batch._Batch._agree), and so changes at the same step on every rank.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.generate import generation_stream

from exokv.config import TEST_HOOKS
from exokv.core.records import TurnRequest
from exokv.rank import speculate
from exokv.rank.draft import Drafter, ScriptedDrafter


def why_not(request: TurnRequest) -> str:
    """Why a batch row decodes without drafts ("": it drafts), the same on every rank.
    A batch holds plain K/V only (exokv.rank.batch.batchable), which trims; a seeded
    sample never runs in a batch."""
    if not request.speculate:
        return "off"
    # A grammar's state and the logprobs follow each token as it is sampled.
    if request.grammar is not None:
        return "a constrained reply decodes one token at a time"
    if request.logprobs is not None:
        return "logprobs are read one token at a time"
    return ""


class RowDrafter:
    """One row's drafter: its prompt and reply so far, and its draft length.

    The reply's tokens reach it as the batch takes them (`catch_up` reads the row's
    generated tokens), so its lookup always ends at the row's newest token. Tests'
    EXOKV_TEST_DRAFTS drafts every row from its list (exokv.rank.draft.ScriptedDrafter):
    local ranks share the environment, so every rank drafts alike."""

    def __init__(self, prompt: Sequence[int]) -> None:
        script = TEST_HOOKS.drafts()
        # No tree, no pass cost: see the module's note.
        self.drafter = Drafter(prompt) if script is None else ScriptedDrafter(prompt, script)
        self.scripted = script is not None
        self.seen = 0  # of the row's generated tokens, those the lookup holds
        self.drafted = 0  # draft tokens the model checked
        self.accepted = 0  # of those, kept in the reply

    def catch_up(self, generated: Sequence[int]) -> None:
        if len(generated) > self.seen:
            self.drafter.advance(0, 0, generated[self.seen :])
            self.seen = len(generated)

    def wants(self, room: int) -> bool:
        """Whether it would draft now, `room` tokens still allowed (its draft's check
        gives one more): asked before the token the step runs is known (the step before
        may still be computing it), so a step with nothing to look up is not waited for."""
        return self.drafter.size(room) > 0 and self.may_find()

    def may_find(self) -> bool:
        """Whether a lookup could find a draft after the next token, whatever it is."""
        return self.scripted or self.drafter.lookup.may_find_after_next()

    def propose(self, room: int) -> tuple[list[int], int]:
        """(its draft, the length it asked for)."""
        k = self.drafter.size(room)
        return (self.drafter.propose(k) if k else []), k

    def checked(self, draft: Sequence[int], kept: int, asked: int) -> None:
        """Its draft's check kept `kept` tokens (the tokens themselves come with the
        row's reply, `catch_up`)."""
        self.drafted += len(draft)
        self.accepted += kept
        self.drafter.advance(len(draft), kept, [], asked=asked)


PROBE_EVERY = 32  # steps without drafts, once they lost, before a step tries them again
WEIGHT = 0.3  # of a new step's rate in the running rates


class Switch:
    """Whether the batch's steps may draft: rank 0's clock says, every rank obeys.

    Kept on the engine (`for_engine`), so that a batch starts from what the last one
    learned; every rank's copy holds the last agreed `on`."""

    def __init__(self) -> None:
        self.on = True  # as agreed at the last step, the same on every rank
        self.plain: float | None = None  # rank 0's tokens/s of steps without drafts
        self.drafted: float | None = None  # and of steps with drafts
        self.off_for = 0  # steps since drafting was last tried while off
        self.last: tuple[bool, int] | None = None  # the last step: (drafted, its tokens)

    def ran(self, drafted: bool, tokens: int) -> None:
        """The step just queued or run: whether it drafted and the tokens it gave."""
        self.last = (drafted, tokens)

    def took(self, seconds: float) -> None:
        """The last step's time on this rank (rank 0's is the one that counts)."""
        if self.last is None or seconds <= 0:
            return
        drafted, tokens = self.last
        self.last = None
        rate = tokens / seconds
        if drafted:
            self.drafted = _blend(self.drafted, rate)
        else:
            self.plain = _blend(self.plain, rate)

    def wanted(self) -> int:
        """Rank 0's say for the next step (1: drafts allowed), before the agreement."""
        if self.plain is None or self.drafted is None or self.drafted >= self.plain:
            self.off_for = 0
            return 1
        self.off_for += 1
        if self.off_for >= PROBE_EVERY:  # the load or the rows may have changed
            self.off_for = 0
            return 1
        return 0


def _blend(old: float | None, new: float) -> float:
    return new if old is None else (1 - WEIGHT) * old + WEIGHT * new


def for_engine(engine: Any) -> Switch:
    switch = getattr(engine, "batch_drafts", None)
    if switch is None:
        switch = Switch()
        engine.batch_drafts = switch
    return switch


def drafter_for(row_tokens: Sequence[int], request: TurnRequest) -> RowDrafter | None:
    return None if why_not(request) else RowDrafter(row_tokens)


def room(row: Any) -> int:
    """The tokens a row's reply may still add."""
    return row.request.max_tokens - len(row.generated)


def wanted(batch: Any) -> bool:
    """Whether any row of `batch` (an exokv.rank.batch._Batch) would draft at this step
    (before its last token is taken: one more may be taken first, so this may say yes
    where the step then drafts nothing), and drafting is on. The step before's time
    is taken here, when it is known (`_Batch.step_s`)."""
    switch = for_engine(batch.engine)
    switch.took(batch.step_s)
    if switch.on:
        for r in batch.active:
            if r.drafter is not None:
                r.drafter.catch_up(r.generated)
                if r.drafter.wants(room(r)):
                    return True
    switch.ran(False, batch._live())
    return False


def pass_tokens(last: Sequence[int], drafts: Sequence[Sequence[int]]) -> mx.array:
    """Each row's token and draft, right-padded (with its own token) to the longest."""
    width = 1 + max(len(d) for d in drafts)
    return mx.array(
        [[t, *d, *[t] * (width - 1 - len(d))] for t, d in zip(last, drafts, strict=True)]
    )


def trim_rows(batch: Sequence[Any], cuts: Sequence[int]) -> None:
    """Take the last cuts[j] positions off row j of every layer of a left-padded batch
    cache (mlx-lm's BatchKVCache): the fewest off all rows, and each row's rest rolled
    out at its right end into its left padding (as mlx-lm ends a right-padded prefill)."""
    low = min(cuts)
    extra = [c - low for c in cuts]
    for c in batch:
        c.trim(low)
        if any(extra):
            c.prepare(right_padding=extra)
            c.finalize()


def step(batch: Any, picked: mx.array, taken: int) -> mx.array:
    """One decode step of `batch` (an exokv.rank.batch._Batch) with drafts: its active
    rows' tokens `picked` (the first `taken` of them already taken) are taken, each
    drafting row proposes, one pass checks them all, each row takes what it keeps;
    returns the rows' next tokens (evaluated), as the plain step's sample."""
    rows, last = batch.active, picked.tolist()
    batch.take_step(last, taken)
    drafts, asked = [], []
    for r in rows:
        d, k = [], 0
        if r.drafter is not None and not batch._ended(r):
            r.drafter.catch_up(r.generated)
            d, k = r.drafter.propose(room(r))
        drafts.append(d)
        asked.append(k)
    if not any(drafts):
        for r, k in zip(rows, asked, strict=True):
            if r.drafter is not None and k:
                r.drafter.checked([], 0, k)  # nothing found: a pause
        following = batch._sample(batch._step(batch.batch, picked), rows, picked)
        mx.eval(following)
        for_engine(batch.engine).ran(True, batch._live())  # a wait that found nothing
        return following
    return _verify(batch, picked, last, drafts, asked)


def _verify(
    batch: Any, picked: mx.array, last: list[int], drafts: list[list[int]], asked: list[int]
) -> mx.array:
    rows = batch.active
    with mx.stream(generation_stream):
        logits = batch.engine.model(pass_tokens(last, drafts), cache=batch.batch)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        targets = mx.argmax(logprobs, axis=-1)
        mx.eval(logprobs, targets)
    chosen = targets.tolist()
    kept, override = [], {}
    for j, (r, d) in enumerate(zip(rows, drafts, strict=True)):
        if not d:
            kept.append(0)
        elif r.request.temp == 0:
            kept.append(speculate.greedy_accept(d, chosen[j]))
        else:
            row = logits[j, : len(d) + 1]
            n, token = speculate._verify(row, d, r.request.temp, r.request.top_p)
            kept.append(n)
            override[j] = token
    now, cuts = time.perf_counter(), []
    width = 1 + max(len(d) for d in drafts)
    for r, d, n, k in zip(rows, drafts, kept, asked, strict=True):
        used = 0
        for token in d[:n]:
            if batch._ended(r):
                break  # an end-of-turn token or a stop among the kept: none after it
            batch._take(r, token, now)
            used += 1
        if r.drafter is not None and k:
            r.drafter.checked(d, n, k)
        cuts.append(width - 1 - used)
    # Each row's next token from its position after what it kept: the plain step's
    # sampler over those rows (grammar, logprobs and temperatures as ever); above
    # temperature 0 a drafting row's is the one its check drew.
    at = mx.array(kept)
    following = batch._sample(logprobs[mx.arange(len(rows)), at], rows, picked)
    if override:
        values = following.tolist()
        for j, token in override.items():
            values[j] = token
        following = mx.array(values, dtype=following.dtype)
    trim_rows(batch.batch, cuts)
    mx.eval(following, [c.state for c in batch.batch])
    for_engine(batch.engine).ran(True, batch._live() + sum(width - 1 - c for c in cuts))
    return following
