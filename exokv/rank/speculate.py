"""Decode with drafts checked by the model, k tokens in one forward pass (issue 33).

Each step runs the last token and a draft (exokv.rank.draft) through the model as one
piece: on a pipeline that is one message per rank for the whole draft, not one per
token. At temperature 0 the longest prefix of the draft that the model's own argmax
agrees with is kept, plus the model's next token, so the reply is the one plain
decoding gives; above 0, speculative sampling (`point_mass_accept`) keeps the
distribution. The positions of rejected draft tokens are trimmed off every layer's
cache, on every rank alike (every rank computes the same logits, and at temperature
> 0 draws the same random numbers: the ranks are seeded alike).

Only caches that every layer can trim (mlx-lm's KVCache and QuantizedKVCache) allow it:
a rotating window (sliding-window layers, --max-kv-size) overwrites what a trim
would have to restore, and a recurrent state (linear attention, SSM) cannot be
rewound; for those `unsupported` says why and the engine decodes plainly.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generation_stream
from mlx_lm.sample_utils import apply_top_p

from exokv.cache import kinds
from exokv.collectives import Group
from exokv.rank.draft import Drafter
from exokv.rank.stops import TextStops

STOP_CHECK_EVERY = 4  # decode steps between stop checks when there are several ranks


def unsupported(cache: Sequence[Any]) -> str:
    """Why drafts cannot be verified in this cache ("" when they can)."""
    found = {leaf.cls[0] for leaf in kinds.leaves(cache)}
    if "window" in found:
        return "a rotating window cache (sliding-window layers or --max-kv-size) cannot be trimmed"
    if "state" in found:
        return "a recurrent state cache cannot be rewound"
    return ""


def greedy_accept(draft: Sequence[int], targets: Sequence[int]) -> int:
    """Draft tokens kept at temperature 0: those the model's own choices agree with.

    targets[i] is the model's choice after the last token and draft[:i]."""
    n = 0
    while n < len(draft) and draft[n] == targets[n]:
        n += 1
    return n


def point_mass_accept(
    probs: np.ndarray, draft: Sequence[int], uniforms: Sequence[float]
) -> tuple[int, int]:
    """Speculative sampling for a draft that is one guess per position (prompt lookup).

    probs[i] is the target distribution after draft[:i] (len(draft) + 1 rows); the
    draft's own distribution is a point mass, so min(1, p/q) is p(draft[i]): draft[i]
    is kept when uniforms[2i] < p(draft[i]); at the first rejection the token is drawn
    from p with draft[i] taken out and the rest renormalised (the residual
    max(0, p - q)), by inverse CDF at uniforms[2i + 1]. With the whole draft kept the
    next token is drawn from probs[-1] at uniforms[-1]. Each token then follows p
    exactly. Returns (draft tokens kept, the next token). Needs 2 len(draft) + 1
    uniforms in [0, 1).
    """
    for i, d in enumerate(draft):
        p = probs[i]
        if uniforms[2 * i] < p[d]:
            continue
        residual = p.astype(np.float64).copy()
        residual[d] = 0.0
        return i, _inverse_cdf(residual, uniforms[2 * i + 1])
    return len(draft), _inverse_cdf(probs[len(draft)].astype(np.float64), uniforms[-1])


def _inverse_cdf(weights: np.ndarray, u: float) -> int:
    cdf = np.cumsum(weights)
    total = cdf[-1]
    if total <= 0:
        return int(np.argmax(weights))
    return int(min(np.searchsorted(cdf, u * total, side="right"), len(weights) - 1))


class StepAgreement:
    """What every rank must agree on at each step: whether to stop, and the draft.

    A draft step's draft is rank 0's, carried to every rank with the stop check in one
    collective. Whether a step drafts at all is the draft policy's decision, which
    every rank takes alike, so plain steps need no collective but the stop check,
    every STOP_CHECK_EVERY steps as in plain decoding.
    """

    def __init__(self, group: Group, should_stop: Callable[[], bool] | None) -> None:
        self.group = group
        self.should_stop = should_stop
        self.plain = 0

    def _local(self) -> bool:
        return self.should_stop() if self.should_stop is not None else False

    def draft_step(self, k: int, drafter: Drafter) -> tuple[bool, list[int]]:
        """Whether to stop, and rank 0's draft of at most `k` tokens; after an empty
        one, rank 0's pause travels too (`Drafter.agreed_pause` on every rank), and
        whether its tree or draft model may still draft (`Drafter.agreed_others`)."""
        if self.group.size == 1:
            draft = drafter.propose(k)
            drafter.agreed_pause = drafter.wanted_pause
            drafter.agreed_others = drafter.others_may_draft()
            return self._local(), draft
        rank0 = self.group.rank == 0
        mine = drafter.propose(k) if rank0 else []
        others = int(drafter.others_may_draft()) if rank0 else 0
        values = [len(mine), drafter.wanted_pause, others, *mine, *[0] * (k - len(mine))]
        stop, shared = self.group.any_with_values(self._local(), values)
        drafter.agreed_pause, drafter.agreed_others = shared[1], bool(shared[2])
        return stop, shared[3 : 3 + shared[0]]

    def plain_step(self) -> bool:
        if self.group.size == 1:
            return self._local()
        self.plain += 1
        if self.plain % STOP_CHECK_EVERY:
            return False
        return self.group.any(self._local())


class ReplyText:
    """A reply's tokens as text, streamed, with its timings (shared by plain decode).

    With stop sequences (exokv.rank.stops) the reply ends where one begins, and what
    could begin one is not streamed until known."""

    def __init__(
        self,
        tokenizer: Any,
        start: float,
        on_text: Callable[[str], None] | None,
        stops: TextStops | None = None,
    ) -> None:
        self.detok = tokenizer.detokenizer
        self.detok.reset()
        self.eos = set(tokenizer.eos_token_ids)
        self.on_text = on_text
        self.stops = stops if stops is not None else TextStops(())
        self.start = start
        self.streamed = 0  # characters passed to on_text
        self.tokens: list[int] = []
        self.ttft = 0.0
        # The decode starts now (its first pass is the first token's): with drafts a
        # pass gives several tokens at once, so the rate is tokens over this whole
        # time, not the tokens after the first over the time since it came.
        self.begun = self.last = time.perf_counter()

    def add(self, token: int) -> bool:
        """Add one token; True when it ends the reply (end-of-turn token, stop text)."""
        self.last = time.perf_counter()
        if not self.tokens:
            self.ttft = self.last - self.start
        self.tokens.append(token)
        if token in self.eos:
            return True
        self.detok.add_token(token)
        if self.stops:
            if self.stops.feed(self.detok.text):
                return True
            shown = self.stops.safe(self.detok.text)
            if self.on_text and shown > self.streamed:
                self.on_text(self.detok.text[self.streamed : shown])
                self.streamed = shown
        elif self.on_text:
            piece = self.detok.last_segment
            self.streamed += len(piece)
            self.on_text(piece)
        return False

    def finish(self) -> tuple[str, float, float]:
        """(text, TTFT, decode tokens/s)."""
        self.detok.finalize()
        reply = self.stops.reply(self.detok.text)
        # Not last_segment: after finalize it can miss what text has (e.g. a U+FFFD for
        # a cut UTF-8 sequence), and what was streamed must be the reply.
        if self.on_text and len(reply) > self.streamed:
            self.on_text(reply[self.streamed :])
        return reply, self.ttft, self.rate()

    def rate(self) -> float:
        """Decode tokens/s: the tokens generated over the decode's wall time."""
        took = self.last - self.begun
        return len(self.tokens) / took if self.tokens and took > 0 else 0.0

    def spelled(self) -> list[int]:
        """The tokens that spell the reply (all but a stop sequence's)."""
        return self.stops.kept(self.tokens)


@dataclass
class Decoded:
    tokens: list[int]  # incl. an end-of-turn token
    reply: str
    finish: str
    ttft: float
    tps: float
    drafted: int = 0  # draft tokens the model checked
    accepted: int = 0  # of those, kept in the reply
    spelled: list[int] = field(default_factory=list)  # the tokens the reply's text is
    model_drafted: int = 0  # of `drafted`, those the draft model proposed (rank 0)
    detail: dict[str, Any] = field(default_factory=dict)  # why it drafted so (Drafter.detail)
    logprobs: list[Any] | None = None  # a request's logprobs (exokv.rank.constrain.entry)


def decode(
    model: Any,
    tokenizer: Any,
    last: int,
    cache: list[Any],
    max_tokens: int,
    start: float,
    drafter: Drafter,
    steps: StepAgreement,
    temp: float = 0.0,
    top_p: float = 1.0,
    on_text: Callable[[str], None] | None = None,
    stops: TextStops | None = None,
) -> Decoded:
    """Generate after `last` (not yet in `cache`), a verify pass at a time.

    When it returns, the cache holds every token of the reply, as after mlx-lm's
    generate_step (which runs each token it yields)."""
    text = ReplyText(tokenizer, start, on_text, stops)
    drafted = accepted = 0
    finish = "length"
    y = last
    # A plain step's token, computed ahead of its step (as generate_step does) while
    # the steps after it are known to be plain: `y` is then in the cache already.
    # Each evaluation holds one forward pass, as in generate_step: on pipeline ranks
    # two passes in one graph can order one rank's sends against another's receives
    # so that both wait (the ring hung so).
    ahead: mx.array | None = None
    # Each step is timed whole, from its start to the next one's (the collective, the
    # pass, the tokens' text): what a step of its size costs here (PassCost).
    timed = _StepClock(drafter)
    with mx.stream(generation_stream):
        while True:
            timed.next_step()
            room = max_tokens - len(text.tokens)
            k = 0 if ahead is not None else drafter.size(room)
            if k:
                stop, draft = steps.draft_step(k, drafter)
            else:
                stop, draft = steps.plain_step() if text.tokens else False, []
            if stop:
                finish = "interrupted"
                break
            was_ahead = ahead is not None
            drafter.ahead_steps += was_ahead
            if draft:
                kept, y = _verify_pass(model, y, draft, cache, drafter, temp, top_p)
            else:
                kept = 0
                y, ahead = _plain_pass(model, y, ahead, cache, drafter, k, room, temp, top_p)
            new = [*draft[:kept], y]
            timed.ran(1 + len(draft), was_ahead)
            drafted, accepted = drafted + len(draft), accepted + kept
            drafter.advance(len(draft), kept, new, asked=k)
            ended, used = _add(text, new, max_tokens)
            if ended is not None:
                finish = ended
                # Tokens past the end were run (kept draft tokens): off the cache too.
                trim(cache, len(new) - used)
                break
        if ahead is None:  # else the token computed ahead ran the last one already
            # The last token into the cache, as generate_step runs it.
            model(mx.array([[text.tokens[-1] if text.tokens else y]]), cache=cache)
        mx.eval([c.state for c in cache])
    reply, ttft, tps = text.finish()
    out = Decoded(text.tokens, reply, finish, ttft, tps, drafted, accepted, text.spelled())
    out.detail = drafter.detail()
    return out


AHEAD_RUN = 4  # plain steps computed ahead timed together (`_StepClock`)


class _StepClock:
    """Times each decode step, start to start, into the drafter's PassCost.

    A plain step computed ahead is timed with the ones around it, AHEAD_RUN at a time:
    its pass began during the step before, so one such step can look almost free
    when the one before it waited long (a busy machine), and the fastest times are
    the ones the cost keeps. Their mean is what such steps cost one after another."""

    def __init__(self, drafter: Drafter) -> None:
        self.cost = drafter.cost
        self.tokens = 0  # the last step's size (0: none yet)
        self.ahead = False  # whether the last step's pass was computed ahead
        self.tic = 0.0
        self.run: list[float] = []  # the times of the latest plain steps computed ahead

    def next_step(self) -> None:
        now = time.perf_counter()
        if self.cost is not None and self.tokens:
            if self.ahead:
                self.run.append(now - self.tic)
            else:
                self.cost.took(self.tokens, now - self.tic)
            if self.run and (not self.ahead or len(self.run) == AHEAD_RUN):
                self.cost.took(1, sum(self.run) / len(self.run))
                self.run = []
        self.tic, self.tokens = now, 0

    def ran(self, tokens: int, ahead: bool = False) -> None:
        self.tokens, self.ahead = tokens, ahead


def _verify_pass(
    model: Any,
    y: int,
    draft: list[int],
    cache: list[Any],
    drafter: Drafter,
    temp: float,
    top_p: float,
) -> tuple[int, int]:
    """One pass over `y` and the draft: how many draft tokens are kept and the model's
    token after them; the rejected ones are taken off the cache."""
    logits = model(mx.array([[y, *draft]]), cache=cache)[0]
    kept, y = _verify(logits, draft, temp, top_p)
    trim(cache, len(draft) - kept)
    return kept, y


def _plain_pass(
    model: Any,
    y: int,
    ahead: mx.array | None,
    cache: list[Any],
    drafter: Drafter,
    k: int,
    room: int,
    temp: float,
    top_p: float,
) -> tuple[int, mx.array | None]:
    """One token without a draft (the one computed ahead, if any), and the next one
    computed ahead when the step after this one is known to be plain as well."""
    token = ahead if ahead is not None else _sample(model, y, cache, temp, top_p)
    if drafter.plain_after(k, room):
        if ahead is None:
            mx.async_eval(token)  # its own evaluation, before the next pass
        ahead = _sample(model, token, cache, temp, top_p)
        mx.async_eval(ahead)
    else:
        ahead = None
    return int(token.item()), ahead


def _add(text: ReplyText, new: list[int], max_tokens: int) -> tuple[str | None, int]:
    """The pass's tokens into the reply, up to its end: the finish reason if it ended
    ("stop" at an end-of-turn token or stop sequence, "length" at max_tokens, else
    None), and how many of `new` it took."""
    used = 0
    for t in new:
        used += 1
        if text.add(t):
            return "stop", used
        if len(text.tokens) >= max_tokens:
            return "length", used
    return None, used


def trim(cache: list[Any], n: int) -> None:
    """Take the last `n` positions off every layer (every rank does the same)."""
    if n > 0:
        for c in cache:
            c.trim(n)


def _sample(model: Any, y: Any, cache: list[Any], temp: float, top_p: float) -> mx.array:
    """The token after `y` (an int, or a token still being computed), lazily."""
    logits = model(mx.array(y).reshape(1, 1), cache=cache)[0, -1].astype(mx.float32)
    if temp == 0:
        return mx.argmax(logits)
    logprobs = logits - mx.logsumexp(logits, keepdims=True)
    if 0 < top_p < 1.0:
        logprobs = apply_top_p(logprobs, top_p)
    return mx.random.categorical(logprobs * (1 / temp))


def _verify(logits: mx.array, draft: list[int], temp: float, top_p: float) -> tuple[int, int]:
    """(draft tokens kept, the next token) from the pass's logits (len(draft) + 1 rows)."""
    if temp == 0:
        targets = mx.argmax(logits, axis=-1).tolist()
        kept = greedy_accept(draft, targets)
        return kept, int(targets[kept])
    logprobs = logits.astype(mx.float32)
    logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
    if 0 < top_p < 1.0:
        logprobs = apply_top_p(logprobs, top_p)
    probs = mx.softmax(logprobs / temp, axis=-1)
    uniforms = mx.random.uniform(shape=(2 * len(draft) + 1,))
    mx.eval(probs, uniforms)
    return point_mass_accept(np.array(probs), draft, np.array(uniforms).tolist())
