"""What a model's family supports, read from its config.json without loading weights.

`exokv models` shows it, and the chat's front end refuses ``--parallel tensor``
for a family mlx-lm cannot shard before any rank starts.
"""

from __future__ import annotations

from typing import Any

from exokv.errors import UsageError
from exokv.model.zoo import build_model

# Caches that hold one slice per token and can be cut at any token.
_SLICE_CACHES = ("KVCache", "QuantizedKVCache")


def describe(config: dict[str, Any]) -> dict[str, Any]:
    """family, cache_kind (slices|snapshots|mixed), pipeline (mlx-lm|generic|None), tensor.

    The model is built from mlx-lm's classes with its lazy init: nothing is computed.
    """
    # deferred: mlx-lm (2 s) only to describe a model; the front end imports this module
    from mlx_lm.models.cache import make_prompt_cache

    from exokv.model import pipeline  # deferred: it imports mlx-lm and mlx.nn

    model = build_model(config)
    kinds = [type(c).__name__ for c in make_prompt_cache(model)]
    slices = sum(kind in _SLICE_CACHES for kind in kinds)
    if slices == len(kinds):
        cache_kind = "slices"
    elif slices == 0:
        cache_kind = "snapshots"
    else:
        cache_kind = "mixed"
    return {
        "family": config.get("model_type"),
        "cache_kind": cache_kind,
        "pipeline": pipeline.pipeline_kind(model),
        "tensor": hasattr(model, "shard"),
    }


def supports_tensor(config: dict[str, Any]) -> bool:
    from mlx_lm.utils import _get_classes  # deferred: mlx-lm (2 s); the front end asks this

    model_class, _ = _get_classes(config)
    return hasattr(model_class, "shard")


def check_parallel(config: dict[str, Any], parallel: str, ranks: int) -> None:
    """A usage error for ``--parallel tensor`` on a family mlx-lm cannot shard."""
    if parallel != "tensor" or ranks < 2:
        return
    try:
        supported = supports_tensor(config)
    except (ValueError, KeyError, ImportError):
        return  # an unknown family: the ranks' load says so in its own words
    if not supported:
        raise UsageError(
            f"--parallel tensor: mlx-lm has no tensor sharding for "
            f"{config.get('model_type')} models; use --parallel pipeline"
        )
