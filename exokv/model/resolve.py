"""From a --model value to a model directory, a loaded model and a stable identity.

A value is one of: ``smollm2`` (the default) or ``gemma3-270m`` (real models
fetched once per machine with pip), ``builtin:tiny|small|base`` (generated on first use), a local
directory, a GGUF file (converted once), ``ollama:NAME[:TAG]`` (a GGUF in ollama's
store), or a Hugging Face repo id ``org/name[@revision]``: its cached snapshot, or
fetched whole from the hub when none is cached (exokv.model.hub; a chat or server
fetches first, onto each host only what its ranks load, see exokv.hosts.fetch).
"""

from __future__ import annotations

import difflib
import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from exokv.errors import ExokvError, UsageError, one_line
from exokv.model import builtin, hub, ollama, zoo
from exokv.model.gguf_models import converted_dir, ensure_gguf_model
from exokv.model.gguf_read import is_gguf
from exokv.model.packaged import MODELS as PACKAGED
from exokv.model.wheel_gguf import ensure_model

BUILTIN_NAMES = ("tiny", "small", "base")
BUILTIN_PREFIX = "builtin:"

_IDENTITY_FILES = (
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "generation_config.json",
)


OLLAMA_PREFIX = "ollama:"


# What --model takes, for the line that refuses a name it cannot find.
MODEL_KINDS = (
    "give smollm2, gemma3-270m, builtin:tiny|small|base or builtin:<family>-tiny, "
    "a model directory, a .gguf file, ollama:NAME[:TAG] or a Hugging Face repo id "
    "org/name[@revision] (`exokv models` lists them)"
)


def nearest_name(name: str) -> str | None:
    """The name --model always takes closest to `name`, if one is close: a packaged
    (real) model first, else a builtin or the zoo's. Builtins are compared without
    their common prefix, which would make any two of them look alike."""
    if not name.startswith(BUILTIN_PREFIX):
        near = difflib.get_close_matches(name, list(PACKAGED), n=1)
        if near:
            return near[0]
    short = name.removeprefix(BUILTIN_PREFIX)
    near = difflib.get_close_matches(short, [*BUILTIN_NAMES, *zoo.zoo_names()], n=1)
    return BUILTIN_PREFIX + near[0] if near else None


def unknown_model(name: str, why: str) -> UsageError:
    """The one line for a --model value that names nothing: why, the nearest known
    name if one is close, and every kind of name accepted."""
    near = nearest_name(name)
    guess = f"did you mean {near}? " if near else ""
    return UsageError(f"model '{name}' not found ({why}): {guess}{MODEL_KINDS}")


def builtin_name(name: str) -> str | None:
    """'builtin:tiny' -> 'tiny', 'builtin:llama-tiny' -> 'llama-tiny'; None if not a builtin."""
    if not name.startswith(BUILTIN_PREFIX):
        return None
    short = name[len(BUILTIN_PREFIX) :]
    if short not in BUILTIN_NAMES and zoo.family_of(short) is None:
        raise unknown_model(name, "no such builtin")
    return short


def _ensure(short: str) -> Path:
    if zoo.family_of(short) is not None:
        return zoo.ensure_zoo(short)
    return builtin.ensure_builtin(short)


def generated_marker(short: str) -> dict[str, Any] | None:
    """A builtin's or zoo model's marker (what generated it); None before it is generated."""
    if zoo.family_of(short) is not None:
        return zoo.read_zoo_marker(short)
    return builtin.read_marker(builtin.builtin_dir(short))


def resolve_model(name: str) -> Path:
    """The directory of model ``name``, generating a builtin on first use."""
    name = name.strip()
    if not name:
        raise UsageError(f"empty model name: {MODEL_KINDS}")
    if name in PACKAGED:
        packaged = PACKAGED[name]
        return _converted(name, lambda: ensure_model(packaged), packaged.converted())
    if name.startswith(OLLAMA_PREFIX):
        blob = ollama.blob_of(name[len(OLLAMA_PREFIX) :])
        return _converted(name, lambda: ensure_gguf_model(blob, label=name), converted_dir(blob))
    short = builtin_name(name)
    if short is not None:
        try:
            return _ensure(short)
        except OSError as e:
            raise ExokvError(
                f"could not generate {name} under {builtin.builtin_dir(short).parent}: {e}; "
                "check that EXOKV_HOME is writable and has free space"
            ) from e

    local = Path(name).expanduser()
    if local.is_dir():
        if not (local / "config.json").is_file():
            raise ExokvError(
                f"model directory '{local}' has no config.json: it is not an mlx-lm model "
                "(convert one with `mlx_lm.convert`)"
            )
        return local
    if local.exists():
        if is_gguf(local):
            return _converted(name, lambda: ensure_gguf_model(local), converted_dir(local))
        raise ExokvError(
            f"model '{name}' is a file but not a GGUF file: pass a model directory or a .gguf"
        )

    repo = hub.parse_name(name)
    if repo is None:
        raise unknown_model(name, f"no such {_path_kind(local)}")
    snapshot = hub.cached_snapshot(*repo)
    if snapshot is not None:
        # What it holds may be one host's part: the loader names a file it lacks.
        return snapshot
    return hub.fetch(*repo).path


def _path_kind(path: Path) -> str:
    """What a missing path was meant to be: a GGUF's name says file, else a directory."""
    return "file" if path.suffix.lower() == ".gguf" else "directory or file"


def _converted(name: str, ensure: Callable[[], Path], where: Path) -> Path:
    """A model fetched or converted on first use; a failure is remembered for this process.

    The chat looks a model up more than once (its identity, then its load): the
    second look repeats the first one's reason at once, not the download or the
    conversion.
    """
    if name in _refused:
        raise _refused[name]
    try:
        return ensure()
    except OSError as e:
        _refused[name] = ExokvError(
            f"could not set up the model under {where.parent}: {e}; "
            "check that the models folder (EXOKV_MODELS) is writable and has free space"
        )
        raise _refused[name] from e
    except ExokvError as e:
        _refused[name] = e
        raise


_refused: dict[str, ExokvError] = {}


def load_model(name: str, *, lazy: bool = False) -> tuple[Any, Any]:
    """(model, tokenizer) loaded by mlx-lm, all weights checked; failures are one line.

    ``lazy`` is accepted for compatibility: every weight is read (and checked) here.
    """
    from exokv.model.loading import load_checkpoint  # deferred: mlx-lm (2 s); only ranks load

    path = resolve_model(name)
    try:
        return load_checkpoint(path)
    except ExokvError:
        raise
    except Exception as e:
        raise ExokvError(f"could not load model '{name}' from {path}: {one_line(e)}"[:400]) from e


def _files_digest(path: Path) -> str:
    """Content of the small files plus what says which weights there are: the index
    (every shard by name, and their total size) where there is one, else the names
    and sizes of the weight files.

    Weights are not read: hashing gigabytes on every start would be too slow,
    and a re-converted checkpoint changes its config or its file sizes. The index,
    not the shards present, because a host may hold only the shards of its layers
    (exokv.hosts.weightfiles lends it those): every host names the model alike.
    """
    digest = hashlib.sha256()
    for fname in _IDENTITY_FILES:
        f = path / fname
        if f.is_file():
            digest.update(fname.encode() + b"\0" + f.read_bytes() + b"\0")
    index = path / hub.INDEX
    if index.is_file():
        digest.update(b"index\0" + index.read_bytes())
        return digest.hexdigest()
    for f in sorted(path.glob("*.safetensors")):
        digest.update(f"{f.name}:{f.stat().st_size}\0".encode())
    return digest.hexdigest()


def model_id(name: str) -> str:
    """A stable identity for ``name``, stored with saved caches to check they match.

    Builtins: ``builtin:tiny@<hash of the generated files>``; cached Hugging Face
    repos: ``org/name@<commit>``; local dirs: ``<dir name>@<hash of its files>``.
    """
    path = resolve_model(name)
    packaged = PACKAGED.get(name.strip())
    if packaged is not None:
        marker = builtin.read_marker(path, packaged.convert_version)
        if marker is None:
            raise ExokvError(f"{name} at {path} is incomplete: delete that directory and retry")
        return f"{packaged.name}@{marker['fingerprint'][:12]}"
    short = builtin_name(name.strip())
    if short is not None:
        marker = generated_marker(short)
        if marker is None:
            raise ExokvError(f"{name} at {path} is incomplete: delete that directory and retry")
        return f"{BUILTIN_PREFIX}{short}@{marker['fingerprint'][:12]}"
    repo = hub.parse_name(name)
    if repo is not None and path.parent.name == "snapshots" and not Path(name).is_dir():
        return f"{repo[0]}@{path.name[:12]}"  # org/name@v1 is the commit v1 names
    return f"{path.resolve().name}@{_files_digest(path)[:12]}"
