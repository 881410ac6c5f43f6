"""Memory probes: what one rank knows about its own memory.

These numbers are local; they only ever decide anything after being gathered
from every rank. The test hook EXOKV_TEST_FAKE_PRESSURE ('0.5' or '0.5,0.97', one
per rank) pins the pressure so tests can play a machine that is short of memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import psutil

from exokv.config import TEST_HOOKS
from exokv.hosts.placement import cache_budget


@dataclass(frozen=True)
class MemorySample:
    pressure: float
    ram_total: int
    rss: int
    mlx_active: int


def sample(rank: int = 0) -> MemorySample:
    vm = psutil.virtual_memory()
    return MemorySample(
        pressure=_pressure(rank, vm.percent / 100.0),
        ram_total=int(vm.total),
        rss=int(psutil.Process().memory_info().rss),
        mlx_active=int(mx.get_active_memory()),
    )


def default_budget(threshold: float, ram_total: int, model_bytes: int) -> int:
    """The bytes of cache a rank may hold when no --cache-budget is given (and no plan
    gave it one): placement's rule, on this rank's share of the machine's RAM."""
    return cache_budget(threshold, ram_total, model_bytes)


def _pressure(rank: int, real: float) -> float:
    pinned = TEST_HOOKS.fake_pressure(rank)
    return real if pinned is None else pinned
