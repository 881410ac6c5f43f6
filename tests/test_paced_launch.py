"""exokv-launch: mlx.launch whose relay threads wait for output instead of spinning on
a rank's always-writable stdin (exokv.launch.paced)."""

from __future__ import annotations

import os
import select
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from mlx._distributed_utils import launch as mlx_launch

from exokv.launch import paced


@pytest.fixture
def pipes() -> Iterator[tuple[int, int, int]]:
    """(a read end with nothing to read yet and its write end, a write end with room)."""
    quiet_r, quiet_w = os.pipe()
    room_r, room_w = os.pipe()
    yield quiet_r, quiet_w, room_w
    for fd in (quiet_r, quiet_w, room_r, room_w):
        os.close(fd)


def test_mlx_launch_still_relays_through_the_name_patched() -> None:
    """The patch replaces mlx.launch's module-level `select` (`from select import
    select`); an mlx whose relay calls it otherwise would spin again unnoticed."""
    assert mlx_launch.select in (select.select, paced.paced_select)
    assert "select(to_read, to_write" in Path(mlx_launch.__file__).read_text()


def test_a_writable_pipe_alone_is_reported_after_a_wait_for_output(
    pipes: tuple[int, int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    quiet_r, _, room_w = pipes
    calls: list[tuple[Any, ...]] = []
    real = select.select

    def recorded(r: list[int], w: list[int], x: list[int], timeout: float | None = None):
        calls.append((list(w), timeout))
        return real(r, w, x, timeout)

    monkeypatch.setattr(paced.select, "select", recorded)
    assert paced.paced_select([quiet_r], [room_w], [], 1.0) == ([], [room_w], [])
    # the relay's loop comes back only after a wait for output (spinning asked with 0)
    assert calls == [([room_w], 0), ([], paced.PACE_S)]


def test_output_is_relayed_at_once_and_writes_still_happen(pipes: tuple[int, int, int]) -> None:
    quiet_r, quiet_w, room_w = pipes
    os.write(quiet_w, b"x")
    assert paced.paced_select([quiet_r], [room_w], [], 1.0) == ([quiet_r], [room_w], [])
    # nothing to write, or a poll (timeout 0): select's own answer
    assert paced.paced_select([quiet_r], [], [], 1.0) == ([quiet_r], [], [])
    assert paced.paced_select([], [room_w], [], 0) == ([], [room_w], [])
