"""The tier options of `exokv chat` and `exokv bench`: --disk-budget, --kv-bits,
--kv-group-size, checked once and turned into a rank's EngineOptions fields.

A rank's disk tier lives in EXOKV_HOME/kv/<model>/<layout>/rank<r>: the same model
on the same rank layout (parallelism, ranks, split, --max-kv-size, --kv-bits) finds
its earlier cache there after a restart; any other layout has its own directory.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from exokv.errors import UsageError

DEFAULT_DISK_BUDGET: str | None = None  # off unless asked for (see README "Disk tier")
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


def parse_disk_budget(text: str, where: Path) -> int:
    """'20GB' -> bytes; 'auto' -> a share of the free space at `where`; '0' -> 0 (off)."""
    from exokv.config import parse_size

    text = text.strip()
    if text == "0":
        return 0
    if text.lower() == "auto":
        from exokv.cache.disk import free_bytes

        return int(AUTO_SHARE * free_bytes(where))
    try:
        return parse_size(text)
    except UsageError:
        raise UsageError(f"--disk-budget {text!r}: use a size (20GB, 512MB), auto or 0") from None


def tier_dir(model: str, layout: str, rank: int) -> Path:
    from exokv.config import exokv_home

    def safe(text: str) -> str:
        return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_") or "model"

    return exokv_home() / "kv" / safe(model) / safe(layout) / f"rank{rank}"


def tier_options(opts: Any, rank: int, layout: str) -> dict[str, Any]:
    """EngineOptions fields for the disk tier and quantized KV, from chat/rank options."""
    bits = getattr(opts, "kv_bits", None)
    group = int(getattr(opts, "kv_group_size", 64) or 64)
    out: dict[str, Any] = {"kv_bits": bits, "kv_group_size": group}
    text = getattr(opts, "disk_budget", None) or DEFAULT_DISK_BUDGET
    if text is None:
        return out
    full = f"{layout}-kv{bits or 16}g{group}-max{getattr(opts, 'max_kv_size', None) or 0}"
    where = tier_dir(opts.model, full, rank)
    budget = parse_disk_budget(text, where)
    # Every rank must have the tier or none (its numbers ride in the turn's gather):
    # `auto` on a rank with no free space is a tier of 0 bytes, not no tier.
    if budget > 0 or text.strip().lower() == "auto":
        out.update(disk_dir=str(where), disk_budget=budget)
    return out


def shown_disk_budget(opts: Any) -> int | None:
    """The disk budget the banner shows (this host's figure for `auto`)."""
    from exokv.config import exokv_home

    text = getattr(opts, "disk_budget", None) or DEFAULT_DISK_BUDGET
    if text is None:
        return None
    return parse_disk_budget(text, exokv_home()) or None
