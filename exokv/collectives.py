"""The collectives the engine needs, behind one small interface.

`LocalGroup` is the one-rank case; `MlxGroup` wraps an `mx.distributed` group.
The engine calls `gather` exactly once per turn for its cache decision.
"""

from __future__ import annotations

import json
from typing import Any, Protocol

import mlx.core as mx
from mlx_lm.generate import generation_stream


class Group(Protocol):
    rank: int
    size: int

    def gather(self, values: list[int]) -> list[list[int]]:
        """Every rank's `values` (same length on all ranks), indexed by rank."""
        ...

    def any(self, flag: bool) -> bool:
        """True on every rank if `flag` is true on any rank."""
        ...

    def any_with(self, flag: bool, value: int) -> tuple[bool, int]:
        """`any(flag)`, carrying rank 0's `value` to every rank in the same collective."""
        ...

    def any_with_values(self, flag: bool, values: list[int]) -> tuple[bool, list[int]]:
        """`any(flag)`, carrying rank 0's `values` (same length on every rank) likewise."""
        ...

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's JSON-serialisable `obj` on every rank."""
        ...


class LocalGroup:
    rank = 0
    size = 1

    def gather(self, values: list[int]) -> list[list[int]]:
        return [list(values)]

    def any(self, flag: bool) -> bool:
        return flag

    def any_with(self, flag: bool, value: int) -> tuple[bool, int]:
        return flag, value

    def any_with_values(self, flag: bool, values: list[int]) -> tuple[bool, list[int]]:
        return flag, list(values)

    def broadcast(self, obj: Any) -> Any:
        return obj


class MlxGroup:
    """Collectives over mx.distributed, on mlx-lm's generation stream.

    Collectives must run in the same order on every rank. generate_step queues the
    next token's forward pass (itself full of send/recv/all_gather or all_sum) on
    that stream before yielding; a collective on any other stream could overtake
    it on one rank and not on another, pairing the wrong messages across ranks.
    On the same stream, each collective waits its turn behind the queued model.
    """

    def __init__(self, group: mx.distributed.Group) -> None:
        self.group = group
        self.rank = group.rank()
        self.size = group.size()

    def gather(self, values: list[int]) -> list[list[int]]:
        local = mx.array(values, dtype=mx.int64)
        out = mx.distributed.all_gather(local, group=self.group, stream=generation_stream)
        return out.reshape(self.size, len(values)).tolist()

    def any(self, flag: bool) -> bool:
        total = mx.distributed.all_sum(
            mx.array([int(flag)]), group=self.group, stream=generation_stream
        )
        return bool(total.item())

    def any_with(self, flag: bool, value: int) -> tuple[bool, int]:
        # A sum of rank 0's value and zeros is rank 0's value: one all_sum for both.
        mine = [int(flag), value if self.rank == 0 else 0]
        total = mx.distributed.all_sum(
            mx.array(mine, dtype=mx.int32), group=self.group, stream=generation_stream
        ).tolist()
        return bool(total[0]), int(total[1])

    def any_with_values(self, flag: bool, values: list[int]) -> tuple[bool, list[int]]:
        # As any_with: a speculative decoding step's stop check and rank 0's draft.
        mine = [int(flag), *(values if self.rank == 0 else [0] * len(values))]
        total = mx.distributed.all_sum(
            mx.array(mine, dtype=mx.int32), group=self.group, stream=generation_stream
        ).tolist()
        return bool(total[0]), [int(v) for v in total[1:]]

    def broadcast(self, obj: Any) -> Any:
        data = json.dumps(obj).encode() if self.rank == 0 else b""
        n = int(
            mx.distributed.all_sum(
                mx.array([len(data)]), group=self.group, stream=generation_stream
            ).item()
        )
        # Rank 0's bytes plus zeros from everyone else: a sum is a broadcast.
        buf = mx.array(list(data), dtype=mx.uint8) if self.rank == 0 else mx.zeros(n, mx.uint8)
        out = mx.distributed.all_sum(buf, group=self.group, stream=generation_stream)
        return json.loads(bytes(out.tolist()).decode())
