"""How many tokens the next prefill step runs: about TARGET_S of work, from the measured rate.

A prefill step ends with the turn's stop check (one collective across ranks) and a
progress report, so its length is how late a Ctrl-C lands and how often the bar moves.
A fixed number of tokens is a fraction of a second on a fast model and tens of seconds
on a slow one (a 70B model, or a cluster over a slow link); a step sized by time is the
same wait on both. The first step is one token (nothing is measured yet), and a step
at most GROWTH times the one before it, since a small step's rate understates a large
one's (fixed costs per step).

A step can be as small as one token: a model slower than a few tokens per quarter
second (SmolLM2 on two loaded cores: 2 to 5 tokens/s, on one rank or two pipeline
ranks) would otherwise run steps of seconds, and a Ctrl-C, the bar's first move and
a turn behind a typeahead step would all wait for them (issue 45). On such a model a
token costs about the same alone or in a batch, so one-token steps cost little.

Under --max-kv-size (a rotating cache that keeps its first tokens) where a step starts
changes the reply: mlx-lm lets the first tokens of each step see the kept tokens once
the conversation outgrows the window, and the later ones not (docs/cache.md). There
the pace sizes steps only inside the first window; past it every step ends on a
multiple of KEPT_GRID, so a turn from a cache hit and the same turn from nothing (or
on a machine of another speed) start their steps at the same positions.

Only rank 0's pace decides; the other ranks take the size it carries (in the turn's stop
collective, in a typeahead step's broadcast), so every rank runs the same steps and
their KV stays identical. Nothing here is random or reads the cache.
"""

from __future__ import annotations

TARGET_S = 0.25  # a step's wall time, stop check and progress report included
FIRST_TOKENS = 1  # the first step, before any rate is known (more: seconds on a slow model)
FEWEST_TOKENS = 1  # a slow model (SmolLM2 on two loaded cores: 2-5 tokens/s) stops in time
MOST_TOKENS = 512  # the largest step (the memory a step's attention needs grows with it)
GROWTH = 4  # a step is at most this many times the step before it
KEPT_GRID = 256  # past a kept-token window, steps end on multiples of this position


def aligned_step(at: int, size: int, window: int) -> int:
    """The tokens of a step from position `at` (the cache's offset) under a rotating
    cache of `window` tokens that keeps its first ones: `size` while the next step
    starts inside the first window (where the cut changes nothing), else up to the
    next multiple of KEPT_GRID, whatever the pace asked."""
    if at + size < window:
        return size
    return (at // KEPT_GRID + 1) * KEPT_GRID - at


class Pace:
    """This rank's measured prefill rate, and the step sizes it gives."""

    def __init__(
        self, target_s: float = TARGET_S, first: int = FIRST_TOKENS, most: int = MOST_TOKENS
    ) -> None:
        self.target_s = target_s
        self.first = first
        self.most = most
        self.rate: float | None = None  # tokens per second over the last step measured
        self._last = 0  # that step's tokens

    def tokens(self) -> int:
        """The size of the next step."""
        if self.rate is None:
            return self.first
        fits = int(self.rate * self.target_s)
        return max(FEWEST_TOKENS, min(fits, self._last * GROWTH, self.most))

    def took(self, tokens: int, seconds: float) -> None:
        """A step of `tokens` took `seconds` (the next step is sized from it)."""
        if tokens <= 0 or seconds <= 0:
            return
        self.rate = tokens / seconds
        self._last = tokens
