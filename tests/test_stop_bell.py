"""Ranks wait for each other asleep on the doorbell, not spinning in mlx (issue 45).

A stop check follows rank 0's share of a prefill step (on a pipeline, rank 0's layers run
after the others'), and mlx's collectives spin while they wait: on one shared machine a
waiting rank took a core from rank 0. Each rank's CountingGroup crosses the doorbell
(exokv.wire.wake) before a stop check: rank 0 rings, the others wait for its byte on a
plain socket, and only then enter the collective. On two pipeline ranks rank 0 waits
for each prefill piece the same way, for rank 1's byte. Here over a socket pair.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import mlx.core as mx
import pytest

from exokv.errors import ExokvError
from exokv.launch.supervise import diagnose
from exokv.model import pipeline
from exokv.rank.engine import prefill
from exokv.rank.main import CountingGroup
from exokv.wire.wake import Doorbell


class Recorded:
    """A group of two whose collectives record when they were entered."""

    rank, size = 1, 2

    def __init__(self, log: list[str]) -> None:
        self.log = log

    def any(self, flag: bool) -> bool:
        self.log.append("any")
        return flag

    def any_with(self, flag: bool, value: int) -> tuple[bool, int]:
        self.log.append("any_with")
        return flag, value

    def any_with_values(self, flag: bool, values: list[int]) -> tuple[bool, list[int]]:
        self.log.append("any_with_values")
        return flag, values


@pytest.fixture
def bells():
    zero_end, other_end = socket.socketpair()
    zero, other = Doorbell(0, [zero_end]), Doorbell(1, [other_end])
    yield zero, other
    zero.close()
    other.close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "check",
    [
        lambda g: g.any(False),
        lambda g: g.any_with(False, 4),
        lambda g: g.any_with_values(False, [1]),
    ],
)
def test_a_stop_check_waits_for_rank_0s_bell_before_its_collective(bells, check) -> None:
    zero, other = bells
    log: list[str] = []
    group = CountingGroup(Recorded(log))
    group.bell = other.cross
    done = threading.Event()
    worker = threading.Thread(target=lambda: (check(group), done.set()), daemon=True)
    worker.start()
    time.sleep(0.2)  # rank 0 still runs its layers of the step
    assert not done.is_set() and log == []  # asleep on the bell, not in the collective
    zero.cross()  # rank 0 reaches the same stop check
    assert done.wait(10)
    assert len(log) == 1 and group.counts["any"] == 1


def test_rank_0_rings_without_waiting_and_the_bytes_pair_up(bells) -> None:
    zero, other = bells
    log: list[str] = []
    group = CountingGroup(Recorded(log))
    group.bell = zero.cross
    for _ in range(3):
        group.any_with(False, 1)  # rank 0: never waits on the bell
    for _ in range(3):
        other.cross()  # one byte for each of rank 0's checks, in order
    assert log == ["any_with"] * 3


def test_rank_0_gone_is_an_error_not_a_hang(bells) -> None:
    zero, other = bells
    zero.close()
    with pytest.raises(ExokvError, match="lost rank 0"):
        other.cross()


def test_a_rank_that_lost_rank_0_on_the_bell_is_not_named_as_the_cause(bells) -> None:
    # Rank 0 failed in a turn; rank 1, asleep on the bell, saw its socket close and
    # exited first. The chat names rank 0's own error, not rank 1's consequence.
    zero, other = bells
    zero.close()
    with pytest.raises(ExokvError) as lost:
        other.cross()
    lines = [
        'exokv-rank-error {"rank": 1, "message": ' + json.dumps(str(lost.value)) + "}",
        "[WARN] Node with rank 1 exited with code 1",
        'exokv-rank-error {"rank": 0, "message": "RuntimeError: out of memory"}',
        "[WARN] Node with rank 0 exited with code 1",
    ]
    assert diagnose(lines, "x").text == "rank 0 failed: RuntimeError: out of memory"


# -- two pipeline ranks: each prefill piece ----------------------------------------------


def test_rank_0_waits_for_rank_1s_piece_asleep(bells) -> None:
    zero, other = bells
    assert zero.piece_bell() is not None and Doorbell(0, []).piece_bell() is None
    last, first = zero.piece_bell(), other.piece_bell()
    first.before_piece()  # rank 1 (the first layers) never waits here
    last.after_piece()  # nor does rank 0 ring
    done = threading.Event()
    worker = threading.Thread(target=lambda: (last.before_piece(), done.set()), daemon=True)
    worker.start()
    time.sleep(0.2)  # rank 1 runs its layers of the piece
    assert not done.is_set()
    first.after_piece()  # its hidden state went to rank 0
    assert done.wait(10)


class Calls:
    """A model whose pieces and bells are logged in order (cut as a pipeline rank cuts)."""

    pipeline_stages = 2

    def __init__(self) -> None:
        self.log: list[str] = []
        self.piece_bell = self

    def before_piece(self) -> None:
        self.log.append("wait")

    def after_piece(self) -> None:
        self.log.append("ring")

    def __call__(self, tokens, cache=None) -> None:
        self.log.append(f"run {tokens.shape[1]}")


class State:
    state = mx.zeros((1,))


def test_each_prefill_piece_waits_then_rings() -> None:
    model = Calls()
    n = pipeline.MICRO_CHUNK * 2 + 3
    prefill(model, [State()], list(range(n)), size=lambda: n)
    pieces = [f"run {b - a}" for a, b in pipeline.micro_chunks(0, n, 2)]
    assert model.log == [x for p in pieces for x in ("wait", p, "ring")]
