"""One rank of `exokv hosts check`'s link test: `python -m exokv.hosts.link_main '<JSON>'`.

Started by mlx.launch exactly as a chat's ranks are (see `exokv.hosts.linktest`), over
the real backend: a handful of one-number all_sums time the round trip (latency)
and a few all_sums of some MB time the throughput (bandwidth). Getting that far
proves the ranks' ports are open between neighbours. Rank 0 prints the figures
as one `LINK_MARK` line on its stdout; beats and the one-line error go to stderr,
as every rank program's do (`exokv.rank.boot`).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from typing import Any

import mlx.core as mx

from exokv.hosts.linktest import LINK_MARK
from exokv.rank.boot import launcher_rank, release_stdin, report_error, start_beating


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    rank = launcher_rank()
    try:
        settings = json.loads(argv[0]) if len(argv) == 1 else None
        if not isinstance(settings, dict):
            raise ValueError("expected one argument: the link test's settings as JSON")
        # Beating before the distributed setup: a rank that started but cannot reach its
        # neighbours is told apart from one that never started.
        parent = settings.get("front_end_pid")
        start_beating(rank, parent, 2)
        release_stdin()  # before the ring: until every rank has, the launcher spins
        world = mx.distributed.init(backend=settings.get("backend", "ring"), strict=True)
        doc = measure(world, int(settings["rounds"]), int(settings["bytes"]))
        if world.rank() == 0:
            print(LINK_MARK + json.dumps(doc), flush=True)
        return 0
    except Exception as err:  # noqa: BLE001 - every failure becomes one line for the front end
        report_error(rank, err, None)
        return 1


def measure(world: Any, rounds: int, nbytes: int) -> dict[str, Any]:
    """Latency and bandwidth of all_sum over `world`, the same figures on every rank."""
    n = world.size()
    one = mx.array([1.0])
    total = mx.distributed.all_sum(one, group=world)
    mx.eval(total)  # the first collective sets the ring up: not timed
    if int(total.item()) != n:
        raise RuntimeError(f"all_sum over {n} ranks gave {total.item()}, not {n}")
    small = []
    for _ in range(rounds):
        start = time.perf_counter()
        mx.eval(mx.distributed.all_sum(one, group=world))
        small.append(time.perf_counter() - start)
    big = mx.ones((nbytes // 4,), dtype=mx.float32)
    mx.eval(big)
    mx.eval(mx.distributed.all_sum(big, group=world))  # warm: buffers allocated
    large = []
    for _ in range(3):
        start = time.perf_counter()
        mx.eval(mx.distributed.all_sum(big, group=world))
        large.append(time.perf_counter() - start)
    # A ring all_sum moves 2(n-1)/n of the buffer over each link (reduce-scatter, then
    # all-gather): per link, that many bytes in the time taken.
    moved = 2 * (n - 1) / n * big.nbytes
    return {
        "ranks": n,
        "latency_s": statistics.median(small),
        "bandwidth_bytes_per_s": moved / statistics.median(large),
        "bytes": int(big.nbytes),
        "rounds": rounds,
    }


if __name__ == "__main__":
    sys.exit(main())
