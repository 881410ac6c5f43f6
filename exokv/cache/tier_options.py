"""A rank's disk tier and quantized KV: --disk-budget (parsed by exokv.core.options)
turned into the rank's EngineOptions fields (exokv.rank.options), and the bounds of
--kv-bits and --kv-group-size.

A chat has a disk tier unless told otherwise (`--disk-budget 0`, `--no-cache` or a
cache budget of 0): by default a quarter of the free space under EXOKV_HOME, which
the banner shows. A rank's tier lives in EXOKV_HOME/kv/<model id>/<layout>/rank<r>
(its tree, journal and lock) and its files in the pool beside it (exokv.cache.disk):
the same model (its identity: name and a digest of its files, so a re-converted
checkpoint at the same path does not read the old one's KV) with the same KV (its
--kv-bits and group, --max-kv-size) finds its earlier cache there after a restart.
A pipeline's layout names neither the ranks nor the split: the files are named by
layer, so a chat on other hosts, fewer or more, reads what they hold. Tensor
parallelism slices every layer by rank count, so its layout names the ranks.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from exokv.cache.disk import free_bytes
from exokv.config import exokv_home
from exokv.core.options import AUTO, ClusterOptions, KvQuant
from exokv.errors import ExokvError, UsageError
from exokv.model import hub
from exokv.model.resolve import model_id
from exokv.state.store import caches_dir

AUTO_SHARE = 0.25  # --disk-budget auto: this share of the free space under EXOKV_HOME
KV_BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)


def check_kv_quantization(kv: KvQuant) -> None:
    """--kv-bits and --kv-group-size: what mlx can quantize the KV cache with."""
    if kv.bits is not None and kv.bits not in KV_BITS:
        raise UsageError(f"--kv-bits {kv.bits}: use 4 or 8")
    if kv.group_size not in GROUP_SIZES:
        raise UsageError(f"--kv-group-size {kv.group_size}: use 32, 64 or 128")


def _head_dim(model: Any) -> int:
    """The model's attention head dimension from its arguments; 0: they do not say."""
    args = getattr(model, "args", None)
    dim = getattr(args, "head_dim", None)
    if not isinstance(dim, int):
        hidden, heads = getattr(args, "hidden_size", None), getattr(args, "num_attention_heads", 0)
        dim = hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads else 0
    return dim


def check_kv_fits(model: Any, kv: KvQuant) -> None:
    """UsageError (the misfit's one line) when the model's arguments already show that
    --kv-group-size cannot divide its heads: said before any work, not after it."""
    dim = _head_dim(model)
    if kv.bits and dim > 0 and dim % kv.group_size:
        raise UsageError(kv_group_misfit(model, kv.bits, kv.group_size, ""))


def kv_group_misfit(model: Any, bits: int, group: int, cause: str) -> str:
    """The one line for a model whose KV head dimension --kv-group-size does not divide
    (mlx quantizes the last axis in groups of 32, 64 or 128, nothing smaller)."""
    dim = _head_dim(model)
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


def disk_bytes(budget: int | Literal["auto"], where: Path, ranks_here: int = 1) -> int:
    """A disk budget in bytes: AUTO is a share of the free space at `where` (divided
    among the ranks sharing this machine's disk)."""
    if budget == AUTO:
        return int(AUTO_SHARE * free_bytes(where) / max(ranks_here, 1))
    return budget


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_") or "model"


def tier_dir(model: str, layout: str, rank: int) -> Path:
    return caches_dir() / _safe(model) / _safe(layout) / f"rank{rank}"


def layout_folder(cluster: ClusterOptions, layout: str) -> str:
    """The folder of a layout's tiers under the model's: a pipeline's names only its KV
    (see the module's docstring). The ranks name the group size only with --kv-bits."""
    kv = cluster.kv if cluster.kv.bits is not None else KvQuant()
    shape = "pipeline" if layout.startswith("pipeline") else layout
    return _safe(f"{shape}-kv{kv.bits or 16}g{kv.group_size}-max{cluster.max_kv_size or 0}")


def model_folder_prefix(model: str) -> str:
    """How the folder of `model`'s tiers begins on any host, without resolving it here
    (its identity's digest may be another host's to compute): its name, then `_`."""
    name = model.strip()
    repo = hub.parse_name(name)
    if repo is not None:
        name = repo[0]
    elif "/" in name or name.startswith(("~", ".")):
        name = Path(name).expanduser().name
    return _safe(name.split("@", 1)[0]) + "_"


def tier_options(
    cluster: ClusterOptions, rank: int, layout: str, ranks_here: int
) -> dict[str, Any]:
    """EngineOptions fields for rank `rank`'s disk tier (none: no tier); `ranks_here`
    share this machine's disk."""
    if cluster.disk_budget is None:
        return {}
    where = tier_dir(_identity(cluster.model), layout_folder(cluster, layout), rank)
    budget = disk_bytes(cluster.disk_budget, where, ranks_here)
    # Every rank must have the tier or none (its numbers ride in the turn's gather):
    # `auto` on a rank with no free space is a tier of 0 bytes, not no tier.
    if budget > 0 or cluster.disk_budget == AUTO:
        return {"disk_dir": str(where), "disk_budget": budget}
    return {}


def shown_disk_budget(opts: ClusterOptions) -> int | None:
    """The disk budget the banner shows (this host's figure for `auto`)."""
    if opts.disk_budget is None:
        return None
    return disk_bytes(opts.disk_budget, exokv_home(), opts.ranks_here) or None


def _identity(model: str) -> str:
    """The model's identity (name and files' digest), or its name where it has none here."""
    try:
        return model_id(model)
    except (ExokvError, OSError):
        return model
