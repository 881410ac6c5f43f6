"""How many tokens the next prefill step runs: about TARGET_S of work, from measured steps.

A prefill step ends with the turn's stop check (one collective across ranks) and a
progress report, so its length is how late a Ctrl-C lands and how often the bar moves.
A fixed number of tokens is a fraction of a second on a fast model and tens of seconds
on a slow one (a 70B model, or a cluster over a slow link); a step sized by time is the
same wait on both. The first step is one token (nothing is measured yet), and a step
at most GROWTH times the one before it.

A step's cost is a line, fixed + per_token * tokens (exokv.rank.costline), fitted to
the steps timed: a step of one token that took a second may be a second of fixed cost
(tensor-parallel ranks on loaded cores spend it in their collectives, whatever the
tokens) or a second of one token (a 70B model on a slow link). Read as tokens per
second, the first would keep every step at one token, a prompt of 40 tokens 40
collectives; the line tells them apart, so the second size timed is twice the first
whenever the first cannot tell. A step then holds what fits in TARGET_S beside the
fixed cost, or as much work as the fixed cost where that alone passes TARGET_S (a
step cannot be shorter than its fixed cost, so it might as well carry tokens).

A step can be as small as one token: a model slower than a few tokens per quarter
second (SmolLM2 on two loaded cores: 2 to 5 tokens/s, on one rank or two pipeline
ranks) would otherwise run steps of seconds, and a Ctrl-C, the bar's first move and
a turn behind a typeahead step would all wait for them (issue 45).

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

from collections import deque
from statistics import median

from exokv.rank.costline import line

TARGET_S = 0.25  # a step's wall time, stop check and progress report included
FIRST_TOKENS = 1  # the first step, before any rate is known (more: seconds on a slow model)
FEWEST_TOKENS = 1  # a slow model (SmolLM2 on two loaded cores: 2-5 tokens/s) stops in time
MOST_TOKENS = 512  # the largest step (the memory a step's attention needs grows with it)
GROWTH = 4  # a step is at most this many times the step before it
WINDOW = 3  # the latest times kept per step size (the pace follows a load that changes)
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
    """This rank's measured prefill steps, and the step sizes they give."""

    def __init__(
        self, target_s: float = TARGET_S, first: int = FIRST_TOKENS, most: int = MOST_TOKENS
    ) -> None:
        self.target_s = target_s
        self.first = first
        self.most = most
        self.times: dict[int, deque[float]] = {}  # a step's tokens -> its latest seconds
        self._last = 0  # the last step's tokens

    def tokens(self) -> int:
        """The size of the next step."""
        if not self.times:
            return self.first
        fixed, per_token = self.cost()
        room = max(self.target_s - fixed, fixed)  # the seconds a step gives its tokens
        fits = int(room / per_token) if per_token > 0 else self.most
        if len(self.times) == 1:
            fits = max(fits, 2 * self._last)  # one size cannot tell fixed from per token
        return max(FEWEST_TOKENS, min(fits, self._last * GROWTH, self.most))

    def cost(self) -> tuple[float, float]:
        """(fixed seconds, seconds per token) of a step, from the steps timed; with one
        size timed, all of it per token (what keeps a slow model's steps small)."""
        points = [(n, median(t), len(t)) for n, t in self.times.items()]
        if len(points) == 1:
            n, seconds, _ = points[0]
            return 0.0, seconds / n
        per_token, fixed = line(points)
        return max(0.0, fixed), per_token

    def took(self, tokens: int, seconds: float) -> None:
        """A step of `tokens` took `seconds` (the next step is sized from it)."""
        if tokens <= 0 or seconds <= 0:
            return
        self.times.setdefault(tokens, deque(maxlen=WINDOW)).append(seconds)
        self._last = tokens
