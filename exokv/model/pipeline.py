"""Pipeline parallelism for every model whose inner model has a list of layers.

Where the family has mlx-lm's own pipeline (``PipelineMixin``: ``model.model.pipeline``)
that is used. Otherwise exokv's generic pipeline, after mlx-lm's convention: rank 0
runs the LAST layers, ``split`` lists layers per rank with rank 0 first, the first
layer of a rank's slice receives the hidden state from the rank after it, the last
one sends it on, and every rank ends with the final hidden state (an all_gather), so
every rank computes the same logits.

The inner model keeps only its slice, so ``model.layers`` and ``make_cache`` give a
cache for this rank's layers only; the bookkeeping a family keeps by layer index
(llama's and gpt-oss's ``layer_types`` and mask indices, gemma3's sliding pattern)
is re-sliced to the local layers.

What crosses between ranks is received into a buffer shaped like the rank's own
embedding output, so that template must have the dtype the hidden state has where
the rank's layers start. It need not be the embedding's: a GGUF's quantized
embedding gives float16 and its float32 norms turn the hidden state to float32 at
the first layer. Received at half its size, the rest of it stayed in the socket
and the next collective read it (the turn's agreed stop came out true on one rank).
``hidden_dtypes`` reads the dtypes off a one-token graph that is never computed.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache, RotatingKVCache

from exokv.errors import ExokvError
from exokv.hosts.placement import local_range

# Tokens a pipeline stage runs before handing the hidden state on (see micro_chunks).
# Measured on builtin:base, 2 ranks on one 2-core machine, a 2,048-token prefill:
# 512-token pieces 925-953 tokens/s, 128: 1277-1373, 64: 1357-1476, 32: no faster.
MICRO_CHUNK = 64


def inner_model(model: Any) -> Any | None:
    """The module that holds the decoder layers (``model.model``), or None."""
    inner = getattr(model, "model", None)
    return inner if isinstance(getattr(inner, "layers", None), list) else None


def pipeline_kind(model: Any) -> str | None:
    """'mlx-lm' where mlx-lm has a pipeline for the class, 'generic' for ours, else None."""
    inner = inner_model(model)
    if inner is None:
        return None
    return "mlx-lm" if hasattr(inner, "pipeline") else "generic"


def stages(model: Any) -> int:
    """How many ranks ``model``'s layers are split across by ``apply_pipeline`` (1: none)."""
    return getattr(model, "pipeline_stages", 1)


def micro_chunks(start: int, end: int, stages: int) -> list[tuple[int, int]]:
    """[start, end) cut into the pieces a prefill evaluates one by one.

    On one rank (or tensor ranks, which all work on every piece) the range is one
    piece. Across pipeline stages a piece is evaluated on a rank as soon as it has
    the previous one's hidden state, and a rank sends its result on before it
    starts the next piece: so while the last stage runs piece k, the first one
    already runs piece k+1 and every stage is busy, except while the first pieces
    fill the pipeline. Pieces of MICRO_CHUNK tokens keep that bubble (stages - 1
    pieces) small against the pieces of a prefill step.
    """
    size = end - start if stages <= 1 else MICRO_CHUNK
    return [(i, min(i + size, end)) for i in range(start, end, max(size, 1))]


def cut_freely(cache: list[Any]) -> bool:
    """Whether a prefill into ``cache`` may be cut into pieces without changing a reply:
    not with a rotating cache that keeps its first tokens (``--max-kv-size``), which
    mlx-lm's chunked prefill lets the first token of each chunk see (docs/cache.md)."""
    return kept_window(cache) is None


def kept_window(cache: list[Any]) -> RotatingKVCache | None:
    """A layer of ``cache`` that is a rotating cache keeping its first tokens
    (``--max-kv-size``: every layer alike), or None."""
    return next((c for c in cache if isinstance(c, RotatingKVCache) and c.keep > 0), None)


def apply_pipeline(model: Any, group: mx.distributed.Group, split: list[int]) -> str:
    """Keep this rank's layers of ``model`` and wire the hidden state between ranks."""
    inner = inner_model(model)
    if inner is None:
        raise ValueError("the model has no list of layers to split")
    rank, size = group.rank(), group.size()
    start, end = local_range(split, rank)
    model.pipeline_stages = size  # read by stages(): prefill overlaps the ranks' work
    dtypes = hidden_dtypes(model)  # before slicing: every layer takes part
    if rank < size - 1:  # this rank receives its first hidden state
        _receive_as(inner, dtypes[start])
    if hasattr(inner, "pipeline"):
        # mlx-lm gathers each rank's last hidden state as it is: they must agree.
        ends = {dtypes[local_range(split, r)[1]] for r in range(size)}
        if len(ends) > 1:
            raise ExokvError(
                "this model's hidden state changes dtype from layer to layer "
                f"({', '.join(sorted(map(str, ends)))}): mlx-lm's pipeline cannot carry it "
                "across ranks; use --parallel tensor or one rank"
            )
        inner.pipeline(group, split)
        return "mlx-lm"
    total = len(inner.layers)
    inner.layers = inner.layers[start:end]
    _RESLICE.get(type(inner).__name__, _reslice_indices)(model, inner, start, end, total)
    # Every rank gathers in the final hidden state's dtype (only rank 0's part is kept).
    last = {"send": rank != 0, "gather": dtypes[-1] if size > 1 else None}
    if len(inner.layers) == 1:  # one layer both receives and sends
        _make_stage(inner.layers[0], group, receive=rank < size - 1, **last)
    else:
        _make_stage(inner.layers[0], group, receive=rank < size - 1)
        _make_stage(inner.layers[-1], group, **last)
    return "generic"


def hidden_dtypes(model: Any) -> list[mx.Dtype]:
    """The hidden state's dtype entering each decoder layer, then leaving the last one,
    on one rank: read off the graph of a one-token forward pass, never computed (so
    no weight is read)."""
    inner = inner_model(model)
    assert inner is not None
    seen: list[mx.Dtype] = []
    bases = [type(layer) for layer in inner.layers]
    recorders: dict[type, type] = {}
    for layer, base in zip(inner.layers, bases, strict=True):
        if base not in recorders:

            def __call__(self: Any, x: mx.array, *args: Any, _base: type = base, **kw: Any) -> Any:
                seen.append(x.dtype)
                out = _base.__call__(self, x, *args, **kw)
                seen.append(out.dtype if isinstance(out, mx.array) else out[0].dtype)
                return out

            recorders[base] = type(base.__name__, (base,), {"__call__": __call__})
        layer.__class__ = recorders[base]
    try:
        model(mx.array([[0]]))
    finally:
        for layer, base in zip(inner.layers, bases, strict=True):
            layer.__class__ = base
    entering = seen[0::2]
    return [*entering, seen[-1]] if seen else []


def _receive_as(inner: Any, dtype: mx.Dtype) -> None:
    """On a rank that receives its hidden state, the embedding output it receives into
    (its values are not used) takes the dtype that state has."""
    embed = getattr(inner, "embed_tokens", None)
    if embed is None:
        raise ExokvError("the model has no token embedding to split the pipeline at")
    base = type(embed)

    def __call__(self: nn.Module, x: mx.array) -> mx.array:
        return base.__call__(self, x).astype(dtype)

    embed.__class__ = type(base.__name__, (base,), {"__call__": __call__})


# -- the hidden state between ranks ---------------------------------------------------


def _make_stage(
    layer: nn.Module,
    group: mx.distributed.Group,
    receive: bool = False,
    send: bool = False,
    gather: mx.Dtype | None = None,
) -> None:
    """Give ``layer`` (in place: same parameters) the pipeline's receive/send steps."""
    base = type(layer)
    prev = group.rank() + 1
    nxt = group.rank() - 1
    signature = inspect.signature(base.__call__)

    def __call__(self: nn.Module, x: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        if receive:
            x = mx.distributed.recv_like(x, prev, group=group)
        out = base.__call__(self, x, *args, **kwargs)
        if send:
            out = mx.distributed.send(out, nxt, group=group)
            # Prefill evaluates only the caches: make them depend on the send, or
            # this rank would never send and the next one would wait forever.
            bound = signature.bind(self, x, *args, **kwargs)
            _depend(bound.arguments.get("cache"), out)
        if gather is not None:
            out = mx.distributed.all_gather(out.astype(gather), group=group)[: out.shape[0]]
        return out

    stage = type(f"Pipeline{base.__name__}", (base,), {"__call__": __call__})
    stage.__module__ = base.__module__
    # A subclass keeps every attribute (use_sliding, is_sliding, ...) and the weights.
    layer.__class__ = stage


def _depend(cache: Any, out: mx.array) -> None:
    if cache is None:
        return
    if getattr(cache, "keys", None) is not None:
        cache.keys = mx.depends(cache.keys, out)
    elif isinstance(getattr(cache, "cache", None), list) and cache.cache[0] is not None:
        cache.cache[0] = mx.depends(cache.cache[0], out)


# -- per-family bookkeeping ------------------------------------------------------------


def _first(items: list[Any], pred: Callable[[Any], bool], default: Any) -> Any:
    return next((i for i, item in enumerate(items) if pred(item)), default)


def _reslice_indices(model: Any, inner: Any, start: int, end: int, total: int) -> None:
    """``layer_types`` and the mask indices that llama, mistral and gpt-oss keep.

    A mask index with no local layer of its kind points at layer 0: the mask is
    then built but never used.
    """
    types = getattr(inner, "layer_types", None)
    if not isinstance(types, list) or len(types) != total:
        return
    inner.layer_types = types = types[start:end]
    kinds = (("fa_idx", "full_attention"), ("ga_idx", "full_attention"))
    for name, kind in (*kinds, ("swa_idx", "sliding_attention")):
        if getattr(inner, name, None) is not None:
            setattr(inner, name, _first(types, lambda t, k=kind: t == k, 0))


def _gemma3(model: Any, inner: Any, start: int, end: int, total: int) -> None:
    """Gemma 3 picks a layer's kind by its index modulo the sliding pattern."""
    inner.__class__ = type("PipelineGemma3Model", (type(inner),), {"__call__": _gemma3_call})
    model.__class__ = type("PipelineGemma3", (type(model),), {"make_cache": _gemma3_cache})


def _gemma3_call(
    self: Any, inputs: mx.array, cache: Any = None, input_embeddings: Any = None
) -> mx.array:
    # gemma3_text's own forward pass, with each layer's kind read from the layer
    # itself instead of from its position in the (now local) list.
    h = input_embeddings if input_embeddings is not None else self.embed_tokens(inputs)
    h *= mx.array(self.args.hidden_size**0.5, mx.bfloat16).astype(h.dtype)
    if cache is None:
        cache = [None] * len(self.layers)
    sliding = [layer.self_attn.is_sliding for layer in self.layers]
    global_at = _first(sliding, lambda s: not s, 0)
    local_at = _first(sliding, lambda s: s, 0)
    global_mask = create_attention_mask(h, cache[global_at])
    window_mask = create_attention_mask(h, cache[local_at], window_size=self.window_size)
    for layer, c, slides in zip(self.layers, cache, sliding, strict=True):
        h = layer(h, window_mask if slides else global_mask, c)
    return self.norm(h)


def _gemma3_cache(self: Any) -> list[Any]:
    return [
        RotatingKVCache(max_size=self.args.sliding_window)
        if layer.self_attn.is_sliding
        else KVCache()
        for layer in self.layers
    ]


_RESLICE: dict[str, Callable[[Any, Any, int, int, int], None]] = {
    "Gemma3Model": _gemma3,
}
