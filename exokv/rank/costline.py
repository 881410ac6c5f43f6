"""A step's cost as a line in its tokens, cost = a + b * tokens, fitted to timed steps.

A forward pass has a fixed part (the Python around it, the collectives between
ranks, reading the weights once on a GPU) and a part that grows with its tokens. Both
users, the prefill pace (exokv.rank.pace) and the draft chooser (exokv.rank.draft),
size their next step from this line rather than from tokens per second, which takes
the fixed part for per-token work and so keeps steps small where they need not be.
"""

from __future__ import annotations


def line(points: list[tuple[int, float, int]]) -> tuple[float, float]:
    """(slope, intercept) of the least-squares line through (tokens, seconds, weight)
    points; the slope ≥ 0 (a longer pass never costs less: noise aside, it does not)."""
    total = sum(w for _, _, w in points)
    mean_x = sum(x * w for x, _, w in points) / total
    mean_y = sum(y * w for _, y, w in points) / total
    var = sum(w * (x - mean_x) ** 2 for x, _, w in points)
    cov = sum(w * (x - mean_x) * (y - mean_y) for x, y, w in points)
    slope = max(0.0, cov / var) if var else 0.0
    return slope, mean_y - slope * mean_x
