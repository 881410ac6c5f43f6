"""Models already pulled with ollama: ``ollama:NAME[:TAG]`` -> the GGUF blob it names.

ollama keeps a manifest per model and tag under
``manifests/<host>/<namespace>/<name>/<tag>`` (``registry.ollama.ai/library`` for
the official models); its layer with media type ``application/vnd.ollama.image.model``
holds the digest of the weights, stored as ``blobs/sha256-<hex>``, a GGUF file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from exokv.errors import ExokvError, UsageError

PREFIX = "ollama:"
REGISTRY = "registry.ollama.ai"
LIBRARY = "library"
MODEL_LAYER = "application/vnd.ollama.image.model"
DEFAULT_TAG = "latest"


def ollama_dir() -> Path:
    """ollama's store: OLLAMA_MODELS, else ~/.ollama/models."""
    env = os.environ.get("OLLAMA_MODELS")
    return Path(env).expanduser() if env else Path.home() / ".ollama" / "models"


def manifest_path(ref: str) -> Path:
    """'llama3.2' -> manifests/registry.ollama.ai/library/llama3.2/latest."""
    name, _, tag = ref.strip().partition(":")
    parts = [p for p in name.split("/")]
    if not name or any(not p or p in (".", "..") for p in parts) or len(parts) > 3:
        raise UsageError(f"invalid ollama model {PREFIX}{ref!r}: use {PREFIX}NAME[:TAG]")
    if ":" in tag or "/" in tag:
        raise UsageError(f"invalid ollama tag in {PREFIX}{ref!r}: use {PREFIX}NAME[:TAG]")
    full = {1: [REGISTRY, LIBRARY], 2: [REGISTRY], 3: []}[len(parts)] + parts
    return ollama_dir().joinpath("manifests", *full, tag or DEFAULT_TAG)


def blob_of(ref: str) -> Path:
    """The GGUF blob of ``ollama:<ref>``; a one-line error when ollama does not have it."""
    path = manifest_path(ref)
    if not path.is_file():
        raise ExokvError(
            f"ollama model '{PREFIX}{ref}' not found: no manifest {path} "
            f"(pull it with `ollama pull {ref}`, or set OLLAMA_MODELS to ollama's store)"
        )
    try:
        manifest = json.loads(path.read_text())
        layers = [x for x in manifest["layers"] if x.get("mediaType") == MODEL_LAYER]
        digest = layers[0]["digest"] if layers else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ExokvError(f"the ollama manifest {path} cannot be read: {e}") from e
    if not isinstance(digest, str) or ":" not in digest:
        raise ExokvError(f"the ollama manifest {path} names no model weights (no GGUF layer)")
    blob = ollama_dir() / "blobs" / digest.replace(":", "-", 1)
    if not blob.is_file():
        raise ExokvError(
            f"ollama model '{PREFIX}{ref}' is incomplete: its weights {blob} are missing "
            f"(pull it again with `ollama pull {ref}`)"
        )
    return blob


def list_ollama() -> list[tuple[str, Path]]:
    """(``ollama:NAME:TAG``, blob) for every model in ollama's store whose blob is there."""
    root = ollama_dir() / "manifests"
    if not root.is_dir():
        return []
    found = []
    for path in sorted(root.glob("*/*/*/*")):
        if not path.is_file():
            continue
        host, namespace, name, tag = path.relative_to(root).parts
        if host == REGISTRY:
            ref = name if namespace == LIBRARY else f"{namespace}/{name}"
        else:
            ref = f"{host}/{namespace}/{name}"
        try:
            found.append((f"{PREFIX}{ref}:{tag}", blob_of(f"{ref}:{tag}")))
        except ExokvError:
            continue  # a half-pulled or foreign entry: not a model exokv can run
    return found
