"""Loading a checkpoint with mlx-lm's own pieces, refusing to run on missing weights.

mlx-lm's sharded loader loads with ``strict=False`` (a rank needs only its own
layers) and finds the weight files with a glob on the model path, so a path
holding ``[1]`` finds no file at all and a checkpoint short of a file loads
silently: the rank runs on random weights. (A host may hold only the weight files
of its ranks' layers, exokv.model.hub: the glob finds those.) Here the weights go through the same
``load_model`` (so sanitize, quantization and the model classes are mlx-lm's), but
from a glob-safe path, and every parameter the rank will use must have been
loaded from the checkpoint with its shape, or the load stops with one line.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.utils import _get_classes, load_model
from mlx_lm.utils import load_tokenizer as mlx_lm_tokenizer

from exokv.errors import ExokvError, UsageError, one_line
from exokv.hosts.placement import even_split, local_range
from exokv.model import pipeline
from exokv.model.hub import layer_of

try:
    from transformers.utils import logging as hf_logging
except ImportError:  # pragma: no cover - mlx-lm depends on transformers
    hf_logging = None

_GLOB_CHARS = "*?["


def load_checkpoint(
    path: Path,
    group: mx.distributed.Group | None = None,
    parallel: str = "pipeline",
    split: list[int] | None = None,
) -> tuple[Any, Any]:
    """(model, tokenizer) for this rank: all of it on one rank, else its shard."""
    ranks = group.size() if group is not None else 1
    rank = group.rank() if group is not None else 0
    with glob_safe(path) as safe:
        seen: dict[str, tuple[int, ...]] = {}
        try:
            model, config = load_model(
                safe, lazy=True, strict=False, get_model_classes=_recording(seen)
            )
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ExokvError(f"could not load the model in {path}: {one_line(e)}"[:400]) from e
        needed = {k: tuple(v.shape) for k, v in tree_flatten(model.parameters())}
        if ranks > 1 and parallel == "tensor":
            check_tensor(model, config, ranks)
            _check_complete(path, needed, seen)
            model.shard(group)
        elif ranks > 1:
            layers = _layer_count(model)
            split = split or even_split(layers, ranks)
            if len(split) != ranks or sum(split) != layers or min(split) <= 0:
                raise UsageError(
                    f"--split {','.join(map(str, split))} does not fit: the model has "
                    f"{layers} layers for {ranks} ranks (one positive count per rank)"
                )
            start, end = local_range(split, rank)
            mine = {k: s for k, s in needed.items() if _in_range(k, start, end)}
            _check_complete(path, mine, seen)
            pipeline.apply_pipeline(model, group, split)
        else:
            _check_complete(path, needed, seen)
        tokenizer = _load_tokenizer(safe, config)
        mx.eval(model.parameters())  # lazy loading: only this rank's weights are read
    return model, tokenizer


def check_tensor(model: Any, config: dict[str, Any], ranks: int) -> None:
    """A usage error unless mlx-lm can shard ``model`` over ``ranks`` ranks."""
    if not hasattr(model, "shard"):
        family = config.get("model_type", "this")
        raise UsageError(
            f"--parallel tensor: mlx-lm has no tensor sharding for {family} models; "
            "use --parallel pipeline"
        )
    heads = config.get("num_key_value_heads") or config.get("num_attention_heads", 0)
    if heads % ranks:
        raise UsageError(
            f"--parallel tensor splits attention heads: {heads} KV heads do not divide "
            f"among {ranks} ranks; use --parallel pipeline or another -n"
        )


@contextlib.contextmanager
def glob_safe(path: Path) -> Iterator[Path]:
    """``path``, or a link to it whose name mlx-lm's glob cannot misread."""
    if not any(c in str(path) for c in _GLOB_CHARS):
        yield path
        return
    tmp = Path(tempfile.mkdtemp(prefix="exokv-model-"))
    try:
        if any(c in str(tmp) for c in _GLOB_CHARS):
            raise ExokvError(
                f"the model path {path} and the temporary directory {tmp} both hold glob "
                "characters ([, *, ?): set TMPDIR to a plain directory"
            )
        link = tmp / "model"
        link.symlink_to(path.resolve(), target_is_directory=True)
        yield link
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _recording(seen: dict[str, tuple[int, ...]]) -> Any:
    """mlx-lm's model classes, with the weights handed to load_weights recorded."""

    def classes(config: dict[str, Any]) -> tuple[type, type]:
        model_class, args_class = _get_classes(config)

        def load_weights(self: Any, weights: Any, strict: bool = True) -> Any:
            if isinstance(weights, list):
                seen.update((k, tuple(v.shape)) for k, v in weights)
            self.__class__ = model_class  # back to mlx-lm's own class
            return model_class.load_weights(self, weights, strict=strict)

        recording = type(model_class.__name__, (model_class,), {"load_weights": load_weights})
        recording.__module__ = model_class.__module__
        return recording, args_class

    return classes


def _check_complete(
    path: Path, needed: dict[str, tuple[int, ...]], seen: dict[str, tuple[int, ...]]
) -> None:
    """One line unless every weight in ``needed`` was loaded, with its shape.

    On several ranks the front end prefixes the rank that failed.
    """
    missing = sorted(k for k in needed if k not in seen)
    wrong = sorted(k for k in needed if k in seen and seen[k] != needed[k])
    if not missing and not wrong:
        return
    files = _missing_files(path, missing)
    if missing:
        what = f"no weights for {len(missing)} of its {len(needed)} parameters (e.g. {missing[0]})"
    else:
        k = wrong[0]
        what = f"weights of the wrong shape for {len(wrong)} parameters (e.g. {k}: {seen[k]})"
    cause = f"; missing file{'s' if len(files) > 1 else ''}: {', '.join(files)}" if files else ""
    raise ExokvError(
        f"the checkpoint in {path} has {what}{cause}; refusing to run on "
        "random weights: download or convert the model again"
    )


def _missing_files(path: Path, missing: list[str]) -> list[str]:
    """The weight files model.safetensors.index.json names for ``missing`` that are not
    there (a host that fetched only its layers' files lacks the others' by design)."""
    try:
        index = json.loads((path / "model.safetensors.index.json").read_text())
        weight_map = index["weight_map"]
        names = {weight_map[k] for k in missing if k in weight_map} or set(weight_map.values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return []
    return sorted(n for n in names if not (path / n).is_file())


def _in_range(key: str, start: int, end: int) -> bool:
    """Shared weights (embeddings, norm, head) and the layers in [start, end)."""
    layer = layer_of(key)
    return layer is None or start <= layer < end


def _layer_count(model: Any) -> int:
    inner = pipeline.inner_model(model)
    if inner is None:
        raise UsageError("this model has no list of layers to split: use --parallel tensor")
    return len(inner.layers)


def load_tokenizer(path: Path) -> tuple[Any, dict[str, Any]]:
    """The tokenizer of the checkpoint in `path` as a rank loads it, and its config, no
    weights read (a front end that renders as the ranks do; a draft model's check)."""
    try:
        config = json.loads((path / "config.json").read_text())
        with glob_safe(path) as safe:
            return _load_tokenizer(safe, config), config
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ExokvError(f"could not load the tokenizer in {path}: {one_line(e)}"[:400]) from e


def _load_tokenizer(path: Path, config: dict[str, Any]) -> Any:
    # transformers reads config.json too and warns about fields only mlx-lm uses.
    level = hf_logging.get_verbosity() if hf_logging else None
    if hf_logging:
        hf_logging.set_verbosity_error()
    try:
        return mlx_lm_tokenizer(
            path, {"trust_remote_code": True}, eos_token_ids=config.get("eos_token_id", None)
        )
    finally:
        if hf_logging and level is not None:
            hf_logging.set_verbosity(level)
