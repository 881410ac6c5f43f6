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
from exokv.model.templates import Format, by_markers

PREFIX = "ollama:"
REGISTRY = "registry.ollama.ai"
LIBRARY = "library"
MODEL_LAYER = "application/vnd.ollama.image.model"
TEMPLATE_LAYER = "application/vnd.ollama.image.template"
SYSTEM_LAYER = "application/vnd.ollama.image.system"
PARAMS_LAYER = "application/vnd.ollama.image.params"
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


def run_defaults(ref: str) -> Format:
    """How ``ollama run`` runs ``ollama:<ref>``, from its manifest's other layers: the
    template (a Go template, mapped to a built-in by its markers; else the GGUF's own,
    said in one line), the default system prompt, and the params' ``stop``,
    ``temperature`` and ``num_ctx``. A layer whose blob is missing or unreadable is
    skipped: the GGUF still runs as it would without it."""
    layers = _layers(ref)
    notes: list[str] = []
    template = None
    go = _text(layers.get(TEMPLATE_LAYER))
    if go is not None and go.strip():
        template = by_markers(go)
        if template is None:
            notes.append(
                f"the template of {PREFIX}{ref} is not one exokv recognises; using the GGUF's "
                "own (choose one with --chat-template)"
            )
    system = _text(layers.get(SYSTEM_LAYER))
    params: dict = {}
    raw = _text(layers.get(PARAMS_LAYER))
    if raw is not None:
        try:
            loaded = json.loads(raw)
            params = loaded if isinstance(loaded, dict) else {}
        except ValueError:
            notes.append(f"the params of {PREFIX}{ref} are not JSON: ignored")
    stop = params.get("stop")
    stops = [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else []
    temperature = params.get("temperature")
    num_ctx = params.get("num_ctx")
    return Format(
        template=template,
        stops=tuple(s for s in stops if isinstance(s, str) and s),
        context=num_ctx if isinstance(num_ctx, int) and num_ctx > 0 else None,
        system=system if system and system.strip() else None,
        temperature=float(temperature)
        if isinstance(temperature, int | float) and temperature >= 0
        else None,
        notes=notes,
    )


def _layers(ref: str) -> dict[str, Path]:
    """Media type -> blob path, for the manifest's layers (the first of each type)."""
    try:
        manifest = json.loads(manifest_path(ref).read_text())
        layers = manifest["layers"]
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    found: dict[str, Path] = {}
    for layer in layers if isinstance(layers, list) else []:
        kind, digest = (
            (layer.get("mediaType"), layer.get("digest"))
            if isinstance(layer, dict)
            else (None, None)
        )
        if isinstance(kind, str) and isinstance(digest, str) and ":" in digest:
            found.setdefault(kind, ollama_dir() / "blobs" / digest.replace(":", "-", 1))
    return found


def _text(path: Path | None) -> str | None:
    if path is None:
        return None
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
