"""Synthetic builtin models: a real qwen2 checkpoint and tokenizer, generated locally.

The builtins exist so that exokv can be tried and tested without a download. They
are generated once per ``EXOKV_HOME`` and must be bit-identical on every machine
(a pipeline over two hosts loads half the layers on each), so nothing here may
depend on the global MLX random state, on dict ordering or on the platform's
floating-point quirks.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from exokv.config import exokv_home
from exokv.model import corpus

# Bump when the generated files change, so stale model dirs are regenerated.
GENERATOR_VERSION = 1
SEED = 20250607
VOCAB_SIZE = 1024
# With mlx's default init a random qwen2 answers every prompt with one repeated
# token; larger weights make the greedy reply depend on the prompt.
WEIGHT_GAIN = 3.0
MARKER = "exokv_builtin.json"

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['content'] is string -%}"
    "{%- set content = message['content'] -%}"
    "{%- else -%}"
    "{%- set content = message['content'] | selectattr('type', 'equalto', 'text')"
    " | map(attribute='text') | join('') -%}"
    "{%- endif -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

_STALE_TMP_SECONDS = 3600
_LAYER_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True)
class BuiltinSpec:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int


# Four layers each, because a pipeline split such as `--split 3,1` must add up to
# the layer count. On a 2-core CPU the attention over a long prompt dominates, so
# base stays narrow enough that a 2,000-token prefill takes a few seconds.
SPECS: dict[str, BuiltinSpec] = {
    "tiny": BuiltinSpec(64, 4, 4, 2, 128),
    "small": BuiltinSpec(128, 4, 4, 2, 384),
    "base": BuiltinSpec(192, 4, 4, 2, 384),
}


def builtin_config(name: str) -> dict[str, Any]:
    """The config.json of a builtin; the eos id is fixed because specials train first."""
    spec = SPECS[name]
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": spec.hidden_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "intermediate_size": spec.intermediate_size,
        "hidden_act": "silu",
        "vocab_size": VOCAB_SIZE,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_traditional": False,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": SPECIAL_TOKENS.index(PAD_TOKEN),
        "eos_token_id": SPECIAL_TOKENS.index(EOS_TOKEN),
        "pad_token_id": SPECIAL_TOKENS.index(PAD_TOKEN),
        "exokv_builtin": {"name": name, "seed": SEED, "generator_version": GENERATOR_VERSION},
    }


def builtin_params(name: str) -> int:
    """Parameter count, computed without generating the model."""
    s = SPECS[name]
    head_dim = s.hidden_size // s.num_attention_heads
    q = s.hidden_size * s.num_attention_heads * head_dim + s.num_attention_heads * head_dim
    kv = 2 * (s.hidden_size * s.num_key_value_heads * head_dim + s.num_key_value_heads * head_dim)
    o = s.num_attention_heads * head_dim * s.hidden_size
    mlp = 3 * s.hidden_size * s.intermediate_size
    layer = q + kv + o + mlp + 2 * s.hidden_size
    return s.num_hidden_layers * layer + 2 * VOCAB_SIZE * s.hidden_size + s.hidden_size


def builtin_dir(name: str) -> Path:
    return exokv_home() / "models" / name


def read_marker(path: Path, version: int = GENERATOR_VERSION) -> dict[str, Any] | None:
    """The completion marker of a generated model dir, or None if incomplete or stale."""
    try:
        marker = json.loads((path / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(marker, dict) or marker.get("generator_version") != version:
        return None
    files = marker.get("files")
    if not isinstance(files, dict) or not files:
        return None
    for fname, size in files.items():
        try:
            if (path / fname).stat().st_size != size:
                return None
        except OSError:
            return None
    return marker


def ensure_builtin(name: str) -> Path:
    """Generate builtin ``name`` under EXOKV_HOME/models once; return its directory."""
    if name not in SPECS:
        raise KeyError(name)
    return ensure_generated(builtin_dir(name), GENERATOR_VERSION, lambda out: _generate(name, out))


def ensure_generated(final: Path, version: int, generate: Callable[[Path], None]) -> Path:
    """Run ``generate(tmp_dir)`` once and move the result to ``final``, across processes.

    ``generate`` must write the marker file last (see ``write_marker``).
    """
    if read_marker(final, version) is not None:
        return final
    name = final.name
    models = final.parent
    models.mkdir(parents=True, exist_ok=True)
    with _generation_lock(models / f".{name}.lock"):
        # Another process may have finished while we waited for the lock.
        if read_marker(final, version) is not None:
            return final
        _remove_stale_tmp(models, name)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-{os.getpid()}-", dir=models))
        try:
            tmp.chmod(0o755)
            generate(tmp)
            # A complete dir that appeared meanwhile came from a process that did
            # not see our lock (e.g. no flock on this filesystem): it is as good as
            # ours and may already be in use, so it stays.
            if read_marker(final, version) is None:
                _move_aside(final)
                try:
                    os.rename(tmp, final)
                except OSError:
                    if read_marker(final, version) is None:
                        raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


@contextlib.contextmanager
def _generation_lock(path: Path) -> Iterator[None]:
    try:
        import fcntl  # deferred: POSIX only
    except ImportError:  # pragma: no cover - not a target platform
        yield
        return
    try:
        fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
    except OSError:
        yield
        return
    try:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        # kill() would address a whole process group, not one process.
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True
    return True


def _remove_stale_tmp(models: Path, name: str) -> None:
    """Delete temp dirs left by interrupted generations (dead pid, or very old)."""
    now = time.time()
    for entry in models.glob(f".tmp-{name}-*"):
        parts = entry.name[len(f".tmp-{name}-") :].split("-")
        pid = int(parts[0]) if len(parts) > 1 and parts[0].isdigit() else -1
        try:
            age = now - entry.stat().st_mtime
        except OSError:
            continue
        if not _pid_alive(pid) or age > _STALE_TMP_SECONDS:
            shutil.rmtree(entry, ignore_errors=True)
    for entry in models.glob(f".old-{name}-*"):
        shutil.rmtree(entry, ignore_errors=True)


def _move_aside(final: Path) -> None:
    """An incomplete or outdated dir at the final name must not block the rename."""
    if not final.exists():
        return
    aside = final.with_name(f".old-{final.name}-{os.getpid()}-{time.time_ns()}")
    os.rename(final, aside)
    shutil.rmtree(aside, ignore_errors=True)


def _generate(name: str, out: Path) -> None:
    config = builtin_config(name)
    write_json(out / "config.json", config)
    write_generation_config(config, out)
    write_tokenizer(out)
    write_weights(_init_weights(config), out)
    write_marker(out, name, GENERATOR_VERSION, builtin_params(name))


def write_generation_config(config: dict[str, Any], out: Path) -> None:
    write_json(
        out / "generation_config.json",
        {"eos_token_id": config["eos_token_id"], "pad_token_id": config["pad_token_id"]},
    )


def write_marker(out: Path, name: str, version: int, params: int) -> None:
    """Written last: its presence is what makes the dir count as complete."""
    files = {p.name: p.stat().st_size for p in sorted(out.iterdir()) if p.is_file()}
    digest = hashlib.sha256()
    for fname in sorted(files):
        digest.update(fname.encode() + b"\0")
        digest.update((out / fname).read_bytes())
    marker = {
        "name": name,
        "seed": SEED,
        "generator_version": version,
        "fingerprint": digest.hexdigest(),
        "params": params,
        "files": files,
    }
    write_json(out / MARKER, marker)


def write_json(path: Path, data: Any) -> None:
    text = json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
    path.write_text(text, encoding="utf-8")


# --- weights ---------------------------------------------------------------------------


def uniform(shape: tuple[int, ...], half_width: float, key_name: str) -> Any:
    """Uniform(-w, w) from SHAKE-256 bits: identical on every platform and library version."""
    import numpy as np  # deferred: numpy (~0.1 s) only to make weights; every chat imports this

    count = int(np.prod(shape))
    stream = hashlib.shake_256(f"exokv:{SEED}:{key_name}".encode()).digest(4 * count)
    raw = np.frombuffer(stream, dtype="<u4")
    # 24 random bits map exactly onto float32, so the arithmetic below is exact or
    # correctly rounded everywhere.
    unit = (raw >> np.uint32(8)).astype(np.float32) * np.float32(2.0**-24)
    values = (unit * np.float32(2.0) - np.float32(1.0)) * np.float32(half_width)
    return mx.array(values.reshape(shape))


def _init_weights(config: dict[str, Any]) -> dict[str, Any]:
    from mlx_lm.models import qwen2  # deferred: mlx-lm (2 s) only to generate a builtin

    args = qwen2.ModelArgs.from_dict(config)
    # Only the names and shapes are used: mlx-lm's own init draws from the global
    # random state, which differs with the caller's history.
    shapes = {k: tuple(v.shape) for k, v in tree_flatten(qwen2.Model(args).parameters())}
    weights = {}
    for key in sorted(shapes):
        shape = shapes[key]
        if key.endswith("norm.weight"):
            weights[key] = mx.ones(shape, dtype=mx.float32)
        elif key.endswith("embed_tokens.weight"):
            # Same variance as mlx's N(0, 1/dims) embedding init, times the gain.
            width = WEIGHT_GAIN * (3.0 / shape[1]) ** 0.5
            weights[key] = uniform(shape, width, key)
        elif len(shape) == 2:
            weights[key] = uniform(shape, WEIGHT_GAIN * shape[1] ** -0.5, key)
        else:
            # A bias: mlx's Linear init bound for its layer, no gain.
            fan_in = shapes[key[: -len("bias")] + "weight"][1]
            weights[key] = uniform(shape, fan_in**-0.5, key)
    return weights


def write_weights(weights: dict[str, Any], out: Path) -> None:
    # One file for the embeddings/norm/head and one per layer, so a pipeline stage
    # reads only the files of its own layers.
    groups: dict[str, dict[str, Any]] = {"shared": {}}
    for key, value in weights.items():
        layer = _LAYER_KEY.search(key)
        group = f"layer{int(layer.group(1)):04d}" if layer else "shared"
        groups.setdefault(group, {})[key] = value
    order = ["shared"] + sorted(g for g in groups if g != "shared")
    total = len(order)
    weight_map = {}
    total_size = 0
    for i, group in enumerate(order, start=1):
        fname = f"model-{i:05d}-of-{total:05d}.safetensors"
        tensors = groups[group]
        mx.save_safetensors(str(out / fname), tensors, metadata={"format": "mlx"})
        for key, value in tensors.items():
            weight_map[key] = fname
            total_size += value.nbytes
    write_json(
        out / "model.safetensors.index.json",
        {"metadata": {"total_size": total_size}, "weight_map": weight_map},
    )


# --- tokenizer -------------------------------------------------------------------------


def write_tokenizer(out: Path) -> None:
    """tokenizer.json (a byte-level BPE trained on the corpus) and its two config files."""
    _trained_tokenizer().save(str(out / "tokenizer.json"), pretty=True)
    _write_tokenizer_configs(out)


def _trained_tokenizer() -> Any:
    """The builtins' tokenizer: byte-level BPE of VOCAB_SIZE tokens, specials first."""
    # deferred: only generating a builtin needs tokenizers; its short names stay local
    from tokenizers import (
        AddedToken,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = corpus.corpus_lines()
    # Single-threaded: the corpus is small, and a process that used the tokenizers
    # thread pool prints a warning in every child it forks later (the rank launcher).
    saved = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        tok.train_from_iterator(lines, trainer, length=len(lines))
    finally:
        if saved is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = saved
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} tokens, expected {VOCAB_SIZE}")
    for i, special in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(special) != i:
            raise RuntimeError(f"special token {special} is not id {i}")
    return tok


def _write_tokenizer_configs(out: Path) -> None:
    """tokenizer_config.json and special_tokens_map.json, as transformers reads them."""
    special_entry = {
        "lstrip": False,
        "normalized": False,
        "rstrip": False,
        "single_word": False,
        "special": True,
    }
    write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "added_tokens_decoder": {
                str(i): {"content": t, **special_entry} for i, t in enumerate(SPECIAL_TOKENS)
            },
            "additional_special_tokens": [SPECIAL_TOKENS[1], SPECIAL_TOKENS[2]],
            "bos_token": None,
            "eos_token": EOS_TOKEN,
            "pad_token": PAD_TOKEN,
            "unk_token": None,
            "chat_template": CHAT_TEMPLATE,
            "clean_up_tokenization_spaces": False,
            "model_max_length": 32768,
            "split_special_tokens": False,
        },
    )
    write_json(
        out / "special_tokens_map.json",
        {
            "additional_special_tokens": [SPECIAL_TOKENS[1], SPECIAL_TOKENS[2]],
            "eos_token": EOS_TOKEN,
            "pad_token": PAD_TOKEN,
        },
    )
