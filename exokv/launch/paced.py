"""`exokv-launch`: mlx.launch, with its relay threads waiting instead of spinning.

mlx.launch relays each rank's output from a thread per rank that select()s the
rank's output for reading and its stdin pipe for writing, whether or not it has
anything to write. A pipe with room is always writable, so the loop turns without
sleeping. For a rank on this machine the front end ends that (the rank lets its
stdin go and a nudge's write then fails, exokv.launch.supervise.Supervisor.nudge);
for a rank on another host the pipe goes to `ssh -tt`, which reads it for as long
as the rank runs, so no write ever fails: an idle chat over two hosts kept 1.3 cores
of the front end's machine busy in the launcher for as long as it ran.

Here the launcher's `select` asks about writing only after a short wait for output:
output is relayed the moment it comes, and what there is to write waits at most
PACE_S. The rest is mlx.launch's own `main`, unchanged (mlx is pinned to the versions
this was checked on; tests/test_paced_launch.py fails if its relay stops using the
name patched here).
"""

from __future__ import annotations

import select
from typing import Any

from mlx._distributed_utils import launch as mlx_launch

PACE_S = 0.05  # how long a write to a rank's stdin may wait (the bootstrap line, nudges)


def paced_select(
    rlist: list[Any], wlist: list[Any], xlist: list[Any], timeout: float | None = None
) -> tuple[list[Any], list[Any], list[Any]]:
    """`select.select`, except that an fd only writable (no output, nothing else) is
    reported after waiting up to PACE_S for output, not at once."""
    if wlist and timeout != 0:
        readable, writable, errors = select.select(rlist, wlist, xlist, 0)
        if readable or errors:
            return readable, writable, errors
        if writable:
            wait = PACE_S if timeout is None else min(timeout, PACE_S)
            readable, _, errors = select.select(rlist, [], xlist, wait)
            return readable, writable, errors
    return select.select(rlist, wlist, xlist, timeout)


def main() -> int | None:
    if mlx_launch.select is select.select:  # else mlx changed its relay: leave it as it is
        mlx_launch.select = paced_select
    return mlx_launch.main()
