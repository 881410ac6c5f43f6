"""Placement: which layers each rank holds and how much cache it may keep, from memory.

Pure arithmetic on gathered numbers (no MLX, no I/O): the front end gathers each
host's memory (exokv.hosts.facts) and the model's per-layer weight bytes (exokv.model
.layer_sizes) and asks `place` for a Plan before any rank starts.

The pipeline's order is mlx-lm's: rank 0 runs the LAST layers, rank r the layers
after those of ranks r+1.. (`local_range`), and `split` lists layers per rank with
rank 0 first, exactly as `--split` does. Every rank also holds the tensors outside
the layers (embedding, final norm, lm_head): each computes the logits.

What a rank may use is `threshold x` its host's usable memory, shared evenly by the
ranks on that host; its cache budget is what is left of that once its weights are
loaded (`cache_budget`, the same rule a rank applies on its own without a plan).
An entry of the prefix cache must fit on every rank, each holding its layers' part
of every token, so the cache holds as many tokens as its tightest rank allows: the
planner splits the layers to make that number as large as it can be, which for
layers of one size is a split in proportion to what each rank can hold.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from exokv.core.sizes import format_size
from exokv.errors import UsageError

# Less room than this many tokens of cache on a rank and the model does not fit.
MIN_CACHE_TOKENS = 2048


def even_split(layers: int, ranks: int) -> list[int]:
    """mlx-lm's default: as even as possible, the low ranks get the extra layers."""
    base, extra = divmod(layers, ranks)
    return [base + (1 if r < extra else 0) for r in range(ranks)]


def local_range(split: Sequence[int], rank: int) -> tuple[int, int]:
    """The [start, end) layers of ``rank``: rank r runs the layers after ranks r+1.."""
    start = sum(split[rank + 1 :])
    return start, start + split[rank]


def layers_text(layers: Sequence[int]) -> str:
    """Layers [start, end) as a plan shows them: `3`, `0-10`."""
    start, end = layers
    return f"{start}" if end - start == 1 else f"{start}-{end - 1}"


def cache_budget(threshold: float, memory: int, weights: int) -> int:
    """The bytes of cache a rank may hold: its share of memory at the threshold, less
    its weights (never below 0)."""
    return max(0, int(threshold * memory) - weights)


@dataclass(frozen=True)
class RankRoom:
    """Where one rank runs: its host's name and usable memory, and the ranks sharing it."""

    host: str
    memory: int  # bytes the host can give its ranks (Metal's working set on a Mac)
    sharing: int = 1  # ranks on that host, this one included

    @property
    def share(self) -> int:
        return self.memory // max(self.sharing, 1)


@dataclass(frozen=True)
class ModelSizes:
    """A model's bytes as placement needs them, read without loading it."""

    layers: list[int]  # weight bytes of each decoder layer, layer 0 first
    shared: int  # the tensors outside the layers: embedding, final norm, lm_head
    kv_per_token: list[int]  # KV cache bytes one token adds to each layer

    def __post_init__(self) -> None:
        if len(self.kv_per_token) != len(self.layers):
            raise ValueError("one KV size per layer")


@dataclass(frozen=True)
class PlanRow:
    rank: int
    host: str
    memory: int  # this rank's share of its host's usable memory
    layers: tuple[int, int] | None  # [start, end); None: a slice of every layer (tensor)
    weights: int  # bytes of weights it loads
    budget: int  # its cache budget
    kv_per_token: int  # bytes one cached token takes on this rank

    @property
    def free_after(self) -> int:
        """What is left of its share once weights and a full cache are in (may be < 0)."""
        return self.memory - self.weights - self.budget

    def layers_text(self) -> str:
        return "all (a slice)" if self.layers is None else layers_text(self.layers)

    def to_dict(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["layers"] = list(self.layers) if self.layers is not None else None
        doc["free_after"] = self.free_after
        return doc


@dataclass(frozen=True)
class Plan:
    rows: list[PlanRow]
    split: list[int] | None  # layers per rank, rank 0 first (as --split); None: tensor
    parallel: str
    source: str  # "auto": placed here; "given": --split as the user gave it
    threshold: float
    budgets_given: bool = False  # --cache-budget replaced the planned budgets

    @property
    def cache_tokens(self) -> int:
        """Tokens the cache can hold before its tightest rank is full."""
        rooms = [r.budget // r.kv_per_token for r in self.rows if r.kv_per_token > 0]
        return min(rooms) if rooms else 0

    @property
    def budgets(self) -> list[int]:
        return [r.budget for r in self.rows]

    def with_budgets(self, budgets: Sequence[int]) -> Plan:
        """The plan with --cache-budget's values in place of the planned ones."""
        rows = [replace(r, budget=b) for r, b in zip(self.rows, budgets, strict=True)]
        return replace(self, rows=rows, budgets_given=True)

    def short(self) -> list[str]:
        """One line per rank whose share does not hold its weights and budget."""
        return [
            f"rank {r.rank} on {r.host}: {format_size(-r.free_after)} short"
            for r in self.rows
            if r.free_after < 0
        ]

    def to_dict(self) -> dict[str, Any]:
        return {
            "split": self.split,
            "parallel": self.parallel,
            "source": self.source,
            "memory_threshold": self.threshold,
            "budgets_given": self.budgets_given,
            "cache_tokens": self.cache_tokens,
            "ranks": [r.to_dict() for r in self.rows],
        }


class DoesNotFit(UsageError):
    """The model cannot be placed on these ranks; `short` is by how many bytes at least."""

    def __init__(self, message: str, short: int) -> None:
        super().__init__(message)
        self.short = short


def plan_split(
    ranks: Sequence[RankRoom],
    sizes: ModelSizes,
    split: Sequence[int],
    threshold: float,
    *,
    shared_on: Collection[int] | None = None,
    source: str = "given",
) -> Plan:
    """The rows for a pipeline split as given: what each rank loads and may cache."""
    if len(split) != len(ranks):
        raise UsageError(f"--split has {len(split)} values for {len(ranks)} ranks")
    if sum(split) != len(sizes.layers) or min(split) < 1:
        raise UsageError(
            f"--split adds up to {sum(split)} layers; the model has {len(sizes.layers)}"
        )
    rows = []
    for r, room in enumerate(ranks):
        start, end = local_range(split, r)
        weights = sum(sizes.layers[start:end]) + _shared(sizes, r, shared_on)
        rows.append(
            PlanRow(
                rank=r,
                host=room.host,
                memory=room.share,
                layers=(start, end),
                weights=weights,
                budget=cache_budget(threshold, room.share, weights),
                kv_per_token=sum(sizes.kv_per_token[start:end]),
            )
        )
    return Plan(rows, list(split), "pipeline", source, threshold)


def place(
    ranks: Sequence[RankRoom],
    sizes: ModelSizes,
    threshold: float,
    *,
    min_tokens: int = MIN_CACHE_TOKENS,
    shared_on: Collection[int] | None = None,
) -> Plan:
    """The pipeline split whose tightest rank has room for the most cached tokens.

    Raises DoesNotFit, saying by how much, when no split leaves every rank room for
    `min_tokens` tokens of cache.
    """
    n, layers = len(ranks), len(sizes.layers)
    if n < 1 or layers < n:
        raise UsageError(f"{n} ranks: the model has {layers} layers, at most one rank per layer")
    caps = [
        int(threshold * room.share) - _shared(sizes, r, shared_on) for r, room in enumerate(ranks)
    ]
    # No KV figures (a config without heads): room in proportion to the layers' bytes,
    # in units fine enough for the search.
    kv = sizes.kv_per_token if any(sizes.kv_per_token) else [w // 1024 + 1 for w in sizes.layers]
    split = _greedy(caps, sizes.layers, kv, min_tokens)
    if split is None:
        raise _refusal(ranks, sizes, caps, kv, threshold, min_tokens, shared_on)
    # The most tokens every rank can hold: double past it, then halve the gap.
    lo, hi = min_tokens, max(2 * min_tokens, 1)
    while _greedy(caps, sizes.layers, kv, hi) is not None:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _greedy(caps, sizes.layers, kv, mid) is None:
            hi = mid
        else:
            lo = mid
    split = _greedy(caps, sizes.layers, kv, lo)
    assert split is not None
    return plan_split(ranks, sizes, split, threshold, shared_on=shared_on, source="auto")


def place_tensor(
    ranks: Sequence[RankRoom],
    sizes: ModelSizes,
    threshold: float,
    *,
    min_tokens: int = MIN_CACHE_TOKENS,
) -> Plan:
    """Tensor parallelism has no split: every rank holds 1/n of every layer (and the
    tensors outside them whole); the plan checks that this fits and sets the budgets."""
    n = len(ranks)
    layer_part = sum(sizes.layers) // n
    kv_part = sum(sizes.kv_per_token) // n
    rows = []
    for r, room in enumerate(ranks):
        weights = layer_part + sizes.shared
        rows.append(
            PlanRow(
                rank=r,
                host=room.host,
                memory=room.share,
                layers=None,
                weights=weights,
                budget=cache_budget(threshold, room.share, weights),
                kv_per_token=kv_part,
            )
        )
    need = [r.weights + min_tokens * kv_part - int(threshold * r.memory) for r in rows]
    worst = max(range(n), key=lambda r: need[r])
    if need[worst] > 0:
        row = rows[worst]
        raise DoesNotFit(
            f"the model does not fit: each of the {n} ranks loads {format_size(row.weights)} "
            f"and needs room for {min_tokens} tokens of cache, but rank {worst} on {row.host} "
            f"has {format_size(int(threshold * row.memory))} at --memory-threshold {threshold}: "
            f"{format_size(need[worst])} short",
            need[worst],
        )
    return Plan(rows, None, "tensor", "auto", threshold)


def _shared(sizes: ModelSizes, rank: int, shared_on: Collection[int] | None) -> int:
    return sizes.shared if shared_on is None or rank in shared_on else 0


def _greedy(caps: list[int], weights: list[int], kv: list[int], tokens: int) -> list[int] | None:
    """A split (rank 0 first) in which every rank holds its layers and `tokens` tokens of
    their cache, or None.

    The ranks take layers in pipeline order (the last rank the first layers). Taking
    as many as fit is not enough with uneven ranks (it can push a heavy layer onto a
    small one), so this keeps, rank by rank, every layer a cut can be at: from each
    reachable cut a rank can end anywhere up to where its room runs out, and both
    ends only move forward (linear in layers per rank).
    """
    n, total = len(caps), len(weights)
    prefix = [0]
    for w, k in zip(weights, kv, strict=True):
        prefix.append(prefix[-1] + w + tokens * k)
    reach = [True] + [False] * total
    froms: list[list[int]] = []
    for r in range(n - 1, -1, -1):
        new, came = [False] * (total + 1), [-1] * (total + 1)
        furthest = end = 0
        for start in range(total):
            if not reach[start]:
                continue
            end = max(end, start)
            while end < total and prefix[end + 1] - prefix[start] <= caps[r]:
                end += 1
            for e in range(max(furthest, start) + 1, end + 1):
                new[e], came[e] = True, start
            furthest = max(furthest, end)
        reach = new
        froms.append(came)
    if not reach[total]:
        return None
    counts, at = [], total
    for came in reversed(froms):  # rank 0's cut first
        counts.append(at - came[at])
        at = came[at]
    return counts


def _refusal(
    ranks: Sequence[RankRoom],
    sizes: ModelSizes,
    caps: list[int],
    kv: list[int],
    threshold: float,
    min_tokens: int,
    shared_on: Collection[int] | None,
) -> DoesNotFit:
    """Why no split fits, and by how many bytes at least."""
    n = len(ranks)
    have = sum(int(threshold * room.share) for room in ranks)
    weights = sum(sizes.layers) + sum(_shared(sizes, r, shared_on) for r in range(n))
    cache = min_tokens * sum(kv)
    need = weights + cache
    at = f"at --memory-threshold {threshold}"
    if need > have:
        return DoesNotFit(
            f"the model does not fit: its weights ({format_size(weights)} on {n} rank"
            f"{'s' if n > 1 else ''}) and room for {min_tokens} tokens of cache "
            f"({format_size(cache)}) need {format_size(need)}, the hosts have "
            f"{format_size(have)} {at}: at least {format_size(need - have)} short",
            need - have,
        )
    # Enough in all, but some rank cannot hold even its smallest part.
    smallest = min(w + min_tokens * k for w, k in zip(sizes.layers, kv, strict=True))
    for r, room in enumerate(ranks):
        if caps[r] < smallest:
            short = smallest - caps[r]
            return DoesNotFit(
                f"the model does not fit: rank {r} on {room.host} has "
                f"{format_size(int(threshold * room.share))} {at}, less than the tensors every "
                f"rank holds and one layer with room for {min_tokens} tokens of cache need: "
                f"{format_size(short)} short there",
                short,
            )
    # Every rank holds one layer, yet no cut of these layers fits: say how much more
    # each rank would need.
    lo, hi = 0, max(need, 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _greedy([c + mid for c in caps], sizes.layers, kv, min_tokens) is None:
            lo = mid
        else:
            hi = mid
    return DoesNotFit(
        f"the model does not fit: no split of its {len(sizes.layers)} layers leaves every rank "
        f"room for {min_tokens} tokens of cache {at}: each rank is {format_size(hi)} short",
        hi,
    )
