"""Which newcomers' prefill slices share a pass, and who waits (exokv.rank.joinfill)."""

from __future__ import annotations

from exokv.rank.joinfill import waits_for, widths


def test_the_first_row_sets_the_width_and_rows_join_while_the_pass_fits() -> None:
    assert widths([20, 18, 25, 3], 100) == [20, 18, 20, 3]  # 4 x 20 <= 100
    assert widths([20, 18, 25, 3, 9, 9], 100) == [20, 18, 20, 3, 9]  # a sixth: 120
    assert widths([2000, 20, 20], 512) == [512]  # a long first row runs alone, a chunk
    assert widths([3, 400, 400], 512) == [3, 3, 3]
    assert widths([50, 50], 8) == [8]  # the pace's first chunk
    assert widths([], 64) == []
    assert widths([7], 0) == [1]  # never an empty pass


def test_a_row_waits_for_an_earlier_one_prefilling_most_of_what_it_lacks() -> None:
    system = list(range(100, 600))
    mine = [*system, 1, 2, 3, 4]
    theirs = [*system, 9, 9]
    assert waits_for(mine, 0, [theirs])  # the shared system prompt: fetched once stored
    assert not waits_for(mine, 500, [theirs])  # the tree holds it: only its question is left
    assert not waits_for(mine, 0, [[*range(7000, 7500)]])  # nothing shared
    assert not waits_for(mine, 0, [])
    assert not waits_for([1, 2], 0, [[1, 2, 3]])  # nothing worth waiting for
