"""Rank 0's box of joining requests (exokv.rank.joins): taken by the batch while it is
open, run as a batch of their own when they come too late for it; and the `join`
message on the wire."""

from __future__ import annotations

import queue

from exokv.core.records import TurnRequest
from exokv.rank.joins import JoinBox
from exokv.wire import messages
from exokv.wire.messages import Batch, BatchRow, Join


def rows(*ids: int) -> list[BatchRow]:
    return [BatchRow(i, TurnRequest(session=f"s{i}", messages=[])) for i in ids]


def test_rows_that_come_while_the_batch_runs_are_taken_in_order() -> None:
    inbox: queue.Queue = queue.Queue()
    box = JoinBox(inbox)
    box.open()
    box.put(Join(rows(3, 4)))
    box.put(Join(rows(5)))
    assert [r.id for r in box.take()] == [3, 4, 5]
    assert box.take() == []
    box.close()
    assert inbox.empty()


def test_rows_not_taken_run_as_a_batch_of_their_own_that_later_ones_join() -> None:
    inbox: queue.Queue = queue.Queue()
    box = JoinBox(inbox)
    box.open()
    box.put(Join(rows(7)))
    box.close()  # the batch ended before its next step took row 7
    box.put(Join(rows(8, 9)))  # came after the batch: they join row 7's at its first step
    box.put(Join(rows(10)))
    left = inbox.get_nowait()
    assert isinstance(left, Batch) and left.join and [r.id for r in left.rows] == [7]
    assert inbox.empty()  # not one batch each, run one after another
    box.open()  # row 7's batch starts
    assert [r.id for r in box.take()] == [8, 9, 10]
    box.close()
    box.put(Join([]))  # nothing to run
    assert inbox.empty()


def test_a_join_while_no_batch_runs_starts_one() -> None:
    inbox: queue.Queue = queue.Queue()
    box = JoinBox(inbox)
    box.put(Join(rows(3)))
    box.put(Join(rows(4)))
    first = inbox.get_nowait()
    assert isinstance(first, Batch) and [r.id for r in first.rows] == [3] and inbox.empty()
    box.open()
    assert [r.id for r in box.take()] == [4]
    box.close()
    box.put(Join(rows(5)))  # the box is closed and empty: a batch of its own again
    assert [r.id for r in inbox.get_nowait().rows] == [5]


def test_join_and_a_joinable_batch_travel_as_json() -> None:
    join = messages.decode(messages.encode(Join(rows(1, 2))))
    assert isinstance(join, Join) and [r.request.session for r in join.rows] == ["s1", "s2"]
    batch = messages.decode(messages.encode(Batch(5, rows(1), join=True)))
    assert isinstance(batch, Batch) and batch.join
    old = messages.encode(Batch(5, rows(1)))
    del old["join"]  # a front end from before joins
    assert messages.decode(old).join is False
