"""The collectives the engine needs, behind one small interface.

`LocalGroup` is the one-rank case; `MlxGroup` wraps an `mx.distributed` group.
The engine calls `gather` exactly once per turn for its cache decision.
"""

from __future__ import annotations

import json
from typing import Any, Protocol

import mlx.core as mx


class Group(Protocol):
    rank: int
    size: int

    def gather(self, values: list[int]) -> list[list[int]]:
        """Every rank's `values` (same length on all ranks), indexed by rank."""
        ...

    def any(self, flag: bool) -> bool:
        """True on every rank if `flag` is true on any rank."""
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

    def broadcast(self, obj: Any) -> Any:
        return obj


class MlxGroup:
    """Collectives over mx.distributed, on the CPU stream so they never wait on the GPU."""

    def __init__(self, group: mx.distributed.Group) -> None:
        self.group = group
        self.rank = group.rank()
        self.size = group.size()

    def gather(self, values: list[int]) -> list[list[int]]:
        local = mx.array(values, dtype=mx.int64)
        out = mx.distributed.all_gather(local, group=self.group, stream=mx.cpu)
        return out.reshape(self.size, len(values)).tolist()

    def any(self, flag: bool) -> bool:
        total = mx.distributed.all_sum(mx.array([int(flag)]), group=self.group, stream=mx.cpu)
        return bool(total.item())

    def broadcast(self, obj: Any) -> Any:
        data = json.dumps(obj).encode() if self.rank == 0 else b""
        n = int(
            mx.distributed.all_sum(mx.array([len(data)]), group=self.group, stream=mx.cpu).item()
        )
        buf = mx.array(list(data), dtype=mx.uint8) if self.rank == 0 else mx.zeros(n, mx.uint8)
        if n == 0:
            return json.loads(data or b"null") if self.rank == 0 else None
        out = mx.distributed.all_sum(buf, group=self.group, stream=mx.cpu)
        return json.loads(bytes(out.tolist()).decode())
