"""GET /metrics: the server's counters in Prometheus's text format (version 0.0.4).

Counted as the access log writes its lines (on the event loop, so no lock): requests
by route (its pattern, `GET /v1/models/{model:path}`; every unknown path is one label,
`unmatched`) and status, tokens in, out and served by the cache; the ranks' cache bytes,
entries and evictions as the last finished turn reported them (every rank's own
figures: the tree is one, the bytes are each rank's shard). Queue depth and requests
in flight are read when scraped.
"""

from __future__ import annotations

from collections import Counter
from typing import Any


class Metrics:
    def __init__(self) -> None:
        self.requests: Counter[tuple[str, int]] = Counter()  # (route, status) -> answered
        self.received = 0  # jobs queued
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.batch = 0  # rows decoded together in the last finished request's batch
        self.cache_bytes: dict[int, int] = {}  # rank -> bytes in its prefix cache (RAM)
        self.cache_entries: dict[int, int] = {}
        self.disk_bytes: dict[int, int] = {}
        self.evictions: Counter[int] = Counter()  # rank -> entries evicted
        self.evicted_bytes: Counter[int] = Counter()  # rank -> bytes those freed

    def queued(self, job: Any) -> None:
        self.received += 1

    def answered(self, route: str, status: int, job: Any = None) -> None:
        self.requests[(route, status)] += 1
        result = job.result if job is not None else None
        if result is None:
            return
        self.prompt_tokens += result.prompt_tokens
        self.completion_tokens += result.generated_tokens
        self.cached_tokens += result.cached_tokens
        self.batch = job.batch
        for stats in result.rank_stats:
            self.cache_bytes[stats.rank] = stats.cache_bytes
            self.cache_entries[stats.rank] = stats.entries
            self.disk_bytes[stats.rank] = stats.disk_bytes
        for event in result.events:
            if event.kind == "evict":
                for rank, freed in enumerate(event.bytes):
                    self.evictions[rank] += 1
                    self.evicted_bytes[rank] += freed

    def render(self, waiting: int, in_flight: int) -> str:
        out: list[str] = []

        def family(name: str, kind: str, about: str, samples: list[tuple[str, float]]) -> None:
            out.append(f"# HELP {name} {about}")
            out.append(f"# TYPE {name} {kind}")
            for labels, value in samples:
                out.append(f"{name}{labels} {_value(value)}")

        requests = [
            (f'{{route="{_quote(route)}",status="{status}"}}', n)
            for (route, status), n in sorted(self.requests.items())
        ]
        family("exokv_requests_total", "counter", "Requests answered.", requests)
        family("exokv_requests_received_total", "counter", "Turns queued.", [("", self.received)])
        family("exokv_prompt_tokens_total", "counter", "Prompt tokens.", [("", self.prompt_tokens)])
        family(
            "exokv_completion_tokens_total",
            "counter",
            "Tokens generated.",
            [("", self.completion_tokens)],
        )
        family(
            "exokv_cached_tokens_total",
            "counter",
            "Prompt tokens the prefix cache served.",
            [("", self.cached_tokens)],
        )
        family("exokv_queue_depth", "gauge", "Requests waiting for the ranks.", [("", waiting)])
        family("exokv_requests_in_flight", "gauge", "Requests not answered yet.", [("", in_flight)])
        family(
            "exokv_batch_size",
            "gauge",
            "Rows decoded together in the last finished request's batch.",
            [("", self.batch)],
        )

        def per_rank(values: dict[int, int]) -> list[tuple[str, float]]:
            return [(f'{{rank="{rank}"}}', v) for rank, v in sorted(values.items())]

        family(
            "exokv_cache_bytes", "gauge", "Prefix cache bytes in RAM.", per_rank(self.cache_bytes)
        )
        family(
            "exokv_cache_entries", "gauge", "Prefix cache entries.", per_rank(self.cache_entries)
        )
        family("exokv_cache_disk_bytes", "gauge", "Disk tier bytes.", per_rank(self.disk_bytes))
        family(
            "exokv_cache_evictions_total",
            "counter",
            "Cache entries evicted.",
            per_rank(dict(self.evictions)),
        )
        family(
            "exokv_cache_evicted_bytes_total",
            "counter",
            "Bytes the evictions freed.",
            per_rank(dict(self.evicted_bytes)),
        )
        return "\n".join(out) + "\n"


def _value(value: float) -> str:
    """A sample's value: a whole number in full (bytes: 1276930, not 1.27693e+06)."""
    if isinstance(value, int) or value.is_integer():
        return str(int(value))
    return repr(value)


def _quote(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
