"""The sampler's constraint hook and its log-probabilities, per reply (or batch row).

A `Constraint` is one reply's grammar state (an llguidance matcher built from the
grammar text the turn's request carries, exokv.prompt.grammar): before each token is
sampled, the tokens the grammar forbids get -inf; each token the reply takes advances
it. Every rank holds the same logits (a pipeline's last hidden state is gathered
everywhere) and samples the same tokens, so every rank's matcher walks the same
tokens and its masks are the same: no mask crosses the wire.

`top_logprobs` reads what OpenAI's `logprobs` report from the distribution a token
was drawn from (the constraint's mask applied, before temperature and top_p).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import llguidance
import llguidance.hf
import mlx.core as mx
import numpy as np

# The tokenizers llguidance has read (about 1 s for a 50k vocabulary), by the tokenizer
# object, vocabulary size and end tokens: built at a rank's first constrained reply, kept.
_LL_TOKENIZERS: dict[tuple[int, int, tuple[int, ...]], Any] = {}


def vocab_size(model: Any, tokenizer: Any) -> int:
    """The logits' width: the model's vocabulary (often padded past the tokenizer's)."""
    args = getattr(model, "args", None)
    size = getattr(args, "vocab_size", 0) or 0
    return max(int(size), len(_hf(tokenizer)))


def _hf(tokenizer: Any) -> Any:
    return getattr(tokenizer, "_tokenizer", tokenizer)  # mlx-lm's wrapper holds HF's


def _ll_tokenizer(tokenizer: Any, vocab: int, eos: tuple[int, ...]) -> Any:
    """llguidance's reading of `tokenizer`, whose end tokens are the engine's (the
    template's end of turn among them), not only the tokenizer's own."""
    key = (id(tokenizer), vocab, eos)
    if key not in _LL_TOKENIZERS:
        hf = _hf(tokenizer)
        ends = list(eos) or None
        _LL_TOKENIZERS[key] = llguidance.hf.from_tokenizer(hf, n_vocab=vocab, eos_token=ends)
    return _LL_TOKENIZERS[key]


class Constraint:
    """One reply's grammar: the mask of its next token, advanced by each token taken."""

    def __init__(self, grammar: str, tokenizer: Any, vocab: int, eos: Iterable[int]) -> None:
        self.vocab = vocab
        self.eos = sorted(t for t in eos if 0 <= t < vocab)
        self.matcher = llguidance.LLMatcher(
            _ll_tokenizer(tokenizer, vocab, tuple(self.eos)), grammar
        )
        self._bits = np.zeros((vocab + 31) // 32, dtype=np.int32)

    def advance(self, token: int) -> None:
        """The reply took `token` (an end of turn ends it: nothing to advance)."""
        if token not in self.eos and not self.matcher.is_error():
            self.matcher.consume_token(token)

    def allowed(self) -> np.ndarray:
        """The tokens the grammar allows next, as booleans over the vocabulary. Where it
        may end (or it cannot go on: a grammar fault), the end-of-turn tokens too."""
        if self.matcher.is_error():
            allowed = np.zeros(self.vocab, dtype=bool)
        else:
            self.matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
            bits = np.unpackbits(self._bits.view(np.uint8), bitorder="little")
            allowed = bits[: self.vocab].astype(bool)
        if self.matcher.is_error() or self.matcher.is_accepting() or not allowed.any():
            allowed[self.eos] = True
        return allowed

    def processor(self, given: int = 1) -> Callable[[mx.array, mx.array], mx.array]:
        """The constraint as one of mlx-lm's `logits_processors` for `generate_step`,
        which passes every token so far: the first `given` (the prompt's, handed to
        it) are not the reply's."""
        seen = given

        def apply(tokens: mx.array, logits: mx.array) -> mx.array:
            nonlocal seen
            for token in tokens[seen:].tolist():  # waits for the token just sampled
                self.advance(int(token))
            seen = len(tokens)
            return masked(logits, [self.allowed()])

        return apply


def masked(logits: mx.array, allowed: list[np.ndarray | None]) -> mx.array:
    """`logits` (one row per entry of `allowed`) with each row's forbidden tokens at
    -inf; a row whose entry is None is left as it is."""
    width = logits.shape[-1]
    rows = []
    for a in allowed:
        row = np.ones(width, dtype=bool) if a is None else a
        if len(row) < width:  # logits wider than the grammar's vocabulary: never those
            row = np.concatenate([row, np.zeros(width - len(row), dtype=bool)])
        rows.append(row[:width])
    mask = mx.array(np.stack(rows))
    return mx.where(mask.reshape(logits.shape), logits, mx.array(-mx.inf, dtype=logits.dtype))


def normalized(logits: mx.array) -> mx.array:
    """Log-probabilities from (masked) logits, one row each."""
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def top_arrays(logprobs: Any, token: Any, k: int) -> tuple[mx.array, mx.array, mx.array]:
    """The chosen token's log-probability and the `k` most likely tokens' ids and
    log-probabilities, most likely first (one row of log-probabilities), as lazy arrays:
    a batch reads them when its step's tokens are taken."""
    row = logprobs.reshape(-1).astype(mx.float32)
    if k <= 0:
        return row[token], mx.array([], dtype=mx.int32), mx.array([], dtype=mx.float32)
    ids = mx.argpartition(-row, kth=k - 1)[:k]
    order = mx.argsort(-row[ids])
    return row[token], ids[order], row[ids[order]]


def top_logprobs(logprobs: mx.array, token: int, k: int) -> tuple[float, list[int], list[float]]:
    """`top_arrays`, read: (chosen's log-probability, ids, log-probabilities)."""
    chosen, ids, values = top_arrays(logprobs, token, k)
    return float(chosen.item()), ids.tolist(), values.tolist()


def entry(tokenizer: Any, token: int, chosen: float, ids: list[int], values: list[float]) -> list:
    """One generated token's report, as TurnResult.logprobs holds it: [text, logprob,
    [[text, logprob], ...]] (the text of each token alone, as the tokenizer decodes it)."""

    def text(t: int) -> str:
        return _hf(tokenizer).decode([t])

    top = [[text(i), _finite(v)] for i, v in zip(ids, values, strict=True)]
    return [text(token), _finite(chosen), top]


def _finite(value: float) -> float:
    # -inf (a token the grammar forbade) is not JSON: OpenAI's clients read -9999.0.
    return value if value > -9999.0 else -9999.0


def for_request(engine: Any, grammar: str | None) -> Constraint | None:
    """The constraint of a turn whose request carries `grammar` (None: unconstrained)."""
    if grammar is None:
        return None
    vocab = vocab_size(engine.model, engine.tokenizer)
    return Constraint(grammar, engine.tokenizer, vocab, engine._eos)
