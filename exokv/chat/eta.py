"""A prefill's time left, from its own progress so far.

A token's prefill costs more the further into the prompt it sits (its attention reads
every token before it), so a long prompt's rate falls as it goes: 5k tokens in 5.8 s,
10k in 24 s on builtin:tiny. The average rate since the start then promises too
little time left. Each reported step, from `p0` to `p1` tokens in `dt` seconds, is
read as `dt = a * (p1 - p0) + b * (p1² - p0²) / 2` (a cost per token growing by `b`
a position); `a` and `b` are fitted to the steps so far (least squares, never below 0)
and the rest of the prompt is priced the same way. The first step is left out: it
carries the turn's start (the trip to the ranks, a cache lookup).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PrefillClock:
    """Fed `(seconds, tokens done)` as a prefill reports them; says the time left."""

    steps: list[tuple[float, float, float]] = field(default_factory=list)  # p0, p1, dt
    _last: tuple[float, int] | None = None

    def report(self, now: float, done: int) -> None:
        if self._last is not None:
            then, before = self._last
            if done > before and now > then:
                self.steps.append((float(before), float(done), now - then))
        if self._last is None or done > self._last[1]:
            self._last = (now, done)

    def left(self, total: int) -> float | None:
        """Seconds to prefill the rest of `total` tokens; None before two steps."""
        if self._last is None or len(self.steps) < 2:
            return None
        done = self._last[1]
        a, b = _fit(self.steps[1:])
        return max(0.0, a * (total - done) + b * (total * total - done * done) / 2)


def _fit(steps: list[tuple[float, float, float]]) -> tuple[float, float]:
    """(a, b) >= 0 with dt ≈ a*n + b*m for each step (n its tokens, m its p1² - p0² over 2)."""
    rows = [(p1 - p0, (p1 * p1 - p0 * p0) / 2, dt) for p0, p1, dt in steps]
    snn = sum(n * n for n, _, _ in rows)
    smm = sum(m * m for _, m, _ in rows)
    snm = sum(n * m for n, m, _ in rows)
    snt = sum(n * t for n, _, t in rows)
    smt = sum(m * t for _, m, t in rows)
    det = snn * smm - snm * snm
    if det > 1e-12 * snn * smm:
        a = (snt * smm - smt * snm) / det
        b = (smt * snn - snt * snm) / det
        if a >= 0 and b >= 0:
            return a, b
    # One term alone: the better of a flat cost per token and a purely growing one.
    flat = (snt / snn, 0.0) if snn else (0.0, 0.0)
    growing = (0.0, smt / smm) if smm else flat
    return min((flat, growing), key=lambda ab: _error(rows, *ab))


def _error(rows: list[tuple[float, float, float]], a: float, b: float) -> float:
    return sum((a * n + b * m - t) ** 2 for n, m, t in rows)


def clock_text(seconds: float) -> str:
    """0:45, 3:05, 1:02:10."""
    whole = int(round(seconds))
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"
