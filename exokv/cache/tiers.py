"""The tier options of `exokv chat` and `exokv bench`: --disk-budget, --kv-bits,
--kv-group-size, checked once and turned into a rank's EngineOptions fields.

A chat has a disk tier unless told otherwise (`--disk-budget 0`, `--no-cache` or a
cache budget of 0): by default a quarter of the free space under EXOKV_HOME, which
the banner shows. A rank's tier lives in EXOKV_HOME/kv/<model id>/<layout>/rank<r>:
the same model (its identity: name and a digest of its files, so a re-converted
checkpoint at the same path does not read the old one's KV) on the same rank layout
(parallelism, ranks, split, --max-kv-size, --kv-bits) finds its earlier cache there
after a restart; anything else has its own directory.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from exokv.errors import UsageError

DEFAULT_DISK_BUDGET = "auto"  # on unless asked otherwise (see README "Disk tier")
AUTO_SHARE = 0.25  # --disk-budget auto: this share of the free space under EXOKV_HOME
KV_BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)


def validate_tier_options(disk_budget: str | None, kv_bits: int | None, group: int) -> None:
    if disk_budget is not None:
        parse_disk_budget(disk_budget, Path("."))
    if kv_bits is not None and kv_bits not in KV_BITS:
        raise UsageError(f"--kv-bits {kv_bits}: use 4 or 8")
    if group not in GROUP_SIZES:
        raise UsageError(f"--kv-group-size {group}: use 32, 64 or 128")


def kv_group_misfit(model: Any, bits: int, group: int, cause: str) -> str:
    """The one line for a model whose KV head dimension --kv-group-size does not divide
    (mlx quantizes the last axis in groups of 32, 64 or 128, nothing smaller)."""
    args = getattr(model, "args", None)
    dim = getattr(args, "head_dim", None)
    if not isinstance(dim, int):
        hidden, heads = getattr(args, "hidden_size", None), getattr(args, "num_attention_heads", 0)
        dim = hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads else 0
    if dim <= 0 or dim % group == 0:  # the arguments do not explain it: mlx's own words
        return f"--kv-bits {bits} --kv-group-size {group} does not fit this model's KV ({cause})"
    fits = [str(g) for g in GROUP_SIZES if dim % g == 0]
    if fits:
        hint = f"use --kv-group-size {' or '.join(fits)}"
    else:
        sizes = ", ".join(map(str, GROUP_SIZES))
        hint = f"mlx quantizes in groups of {sizes} only, so leave out --kv-bits for this model"
    return (
        f"--kv-bits {bits} --kv-group-size {group}: this model's attention head dimension is "
        f"{dim}, not a multiple of {group}; {hint}"
    )


def parse_disk_budget(text: str, where: Path, ranks_here: int = 1) -> int:
    """'20GB' -> bytes; 'auto' -> a share of the free space at `where` (divided among
    the ranks sharing this machine's disk); '0' -> 0 (off)."""
    from exokv.sizes import parse_size

    text = text.strip()
    if text == "0":
        return 0
    if text.lower() == "auto":
        from exokv.cache.disk import free_bytes

        return int(AUTO_SHARE * free_bytes(where) / max(ranks_here, 1))
    try:
        return parse_size(text)
    except UsageError:
        raise UsageError(f"--disk-budget {text!r}: use a size (20GB, 512MB), auto or 0") from None


def tier_dir(model: str, layout: str, rank: int) -> Path:
    from exokv.state.store import caches_dir

    def safe(text: str) -> str:
        return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_") or "model"

    return caches_dir() / safe(model) / safe(layout) / f"rank{rank}"


def tier_options(opts: Any, rank: int, layout: str) -> dict[str, Any]:
    """EngineOptions fields for the disk tier and quantized KV, from chat/rank options."""
    bits = getattr(opts, "kv_bits", None)
    group = int(getattr(opts, "kv_group_size", 64) or 64)
    out: dict[str, Any] = {"kv_bits": bits, "kv_group_size": group}
    text = disk_budget_text(opts)
    if text is None:
        return out
    full = f"{layout}-kv{bits or 16}g{group}-max{getattr(opts, 'max_kv_size', None) or 0}"
    where = tier_dir(_identity(opts.model), full, rank)
    budget = parse_disk_budget(text, where, int(getattr(opts, "ranks_here", 1) or 1))
    # Every rank must have the tier or none (its numbers ride in the turn's gather):
    # `auto` on a rank with no free space is a tier of 0 bytes, not no tier.
    if budget > 0 or text.strip().lower() == "auto":
        out.update(disk_dir=str(where), disk_budget=budget)
    return out


def shown_disk_budget(opts: Any) -> int | None:
    """The disk budget the banner shows (this host's figure for `auto`)."""
    from exokv.config import exokv_home

    text = disk_budget_text(opts)
    if text is None:
        return None
    # Ranks on several hosts each have a disk of their own; -n N share this one.
    several_hosts = getattr(opts, "hosts", None) or getattr(opts, "hostfile", None)
    ranks_here = 1 if several_hosts else int(getattr(opts, "ranks", 1) or 1)
    return parse_disk_budget(text, exokv_home(), ranks_here) or None


def disk_budget_text(opts: Any) -> str | None:
    """--disk-budget as given, the default, or None when the chat keeps no cache."""
    if getattr(opts, "no_cache", False):
        return None
    budgets = getattr(opts, "budgets", None) or getattr(opts, "cache_budget", None) or ""
    if any(_is_zero(b) for b in str(budgets).split(",")):
        return None  # a rank keeps nothing: nothing to spill either
    return getattr(opts, "disk_budget", None) or DEFAULT_DISK_BUDGET


def _is_zero(size: str) -> bool:
    from exokv.sizes import parse_size

    try:
        return size.strip() != "" and parse_size(size.strip()) == 0
    except UsageError:
        return False  # reported by the option's own check


def _identity(model: str) -> str:
    """The model's identity (name and files' digest), or its name where it has none here."""
    from exokv.errors import ExokvError
    from exokv.model.resolve import model_id

    try:
        return model_id(model)
    except (ExokvError, OSError):
        return model
