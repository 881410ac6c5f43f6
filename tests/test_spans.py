"""Which positions a sliding-window layer keeps: plain lists, no MLX."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from exokv.cache import spans


def test_window_needs_follow_mlx_lms_rotating_cache():
    assert spans.window_needs(0, 16, 0) == []
    assert spans.window_needs(10, 16, 0) == [(0, 10)]  # not full yet: everything
    assert spans.window_needs(16, 16, 4) == [(0, 16)]
    assert spans.window_needs(40, 16, 0) == [(24, 40)]
    assert spans.window_needs(40, 16, 4) == [(0, 4), (28, 40)]  # kept tokens + the rest


def test_missing_clip_and_keep():
    held = [(0, 4), (10, 20)]
    assert spans.missing(held, 0, 25) == [(4, 10), (20, 25)]
    assert spans.clip(held, 2, 12) == [(2, 4), (10, 12)]
    assert spans.covers(held, 11, 19) and not spans.covers(held, 3, 11)
    # A node ending at 30 with a window of 16 (4 kept) keeps [0, 4) and [18, 30).
    assert spans.keep_for_end([(0, 30)], 30, 16, 4) == [(0, 4), (18, 30)]


@given(
    end=st.integers(1, 80),
    window=st.integers(2, 32),
    keep=st.integers(0, 4),
    deeper=st.integers(0, 40),
)
def test_what_a_node_keeps_serves_every_fetch_at_its_end_or_below(end, window, keep, deeper):
    """Kept for a node ending at `end`: all a fetch ending there needs, and all a fetch
    further down (at end + deeper) needs of this node's positions."""
    keep = min(keep, window - 1)
    kept = spans.keep_for_end([(0, end)], end, window, keep)
    for length in (end, end + deeper):
        for a, b in spans.window_needs(length, window, keep):
            assert spans.covers(kept, a, min(b, end))
