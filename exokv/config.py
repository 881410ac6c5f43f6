"""Settings from the environment, state paths and size parsing."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from exokv.errors import UsageError
from exokv.sizes import parse_size

DEFAULT_MODEL = "smollm2"
DEFAULT_MEMORY_THRESHOLD = 0.9


def exokv_home() -> Path:
    """The state directory: EXOKV_HOME, else the platform's per-user state dir."""
    env = os.environ.get("EXOKV_HOME")
    if env:
        return Path(env).expanduser()
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Application Support" / "exokv"
    xdg = os.environ.get("XDG_STATE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".local" / "state"
    return base / "exokv"


def machine_models_dir() -> Path:
    """Converted real models, shared by every EXOKV_HOME on this machine.

    EXOKV_MODELS, else the platform's per-user cache dir: a conversion is
    redone from its source if lost, and tests and sessions share one copy.
    """
    env = os.environ.get("EXOKV_MODELS")
    if env:
        return Path(env).expanduser()
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Caches" / "exokv" / "models"
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "exokv" / "models"


def default_model() -> str:
    return os.environ.get("EXOKV_MODEL") or DEFAULT_MODEL


def debug_enabled() -> bool:
    return os.environ.get("EXOKV_DEBUG", "") not in ("", "0")


def parse_budgets(text: str | None, ranks: int) -> list[int] | None:
    """'64MB,16MB' -> one budget per rank; a single value applies to every rank."""
    if text is None:
        return None
    parts = [p for p in text.split(",")]
    if any(not p.strip() for p in parts):
        raise UsageError(f"invalid --cache-budget {text!r}: an empty value between commas")
    sizes = [parse_size(p) for p in parts]
    if len(sizes) == 1:
        return sizes * ranks
    if len(sizes) != ranks:
        raise UsageError(
            f"--cache-budget has {len(sizes)} values for {ranks} ranks: give one, or one per rank"
        )
    return sizes
