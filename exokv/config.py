"""Settings from the environment, state paths and size parsing."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from exokv.errors import UsageError

DEFAULT_MODEL = "smollm2"
DEFAULT_MEMORY_THRESHOLD = 0.9

_UNITS = {
    "": 1,
    "B": 1,
    "K": 1000,
    "KB": 1000,
    "KIB": 1024,
    "M": 1000**2,
    "MB": 1000**2,
    "MIB": 1024**2,
    "G": 1000**3,
    "GB": 1000**3,
    "GIB": 1024**3,
    "T": 1000**4,
    "TB": 1000**4,
    "TIB": 1024**4,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")


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


def parse_size(text: str) -> int:
    """'2GB' -> 2_000_000_000; '64MiB' -> 67_108_864. Raises UsageError."""
    match = _SIZE.match(text)
    unit = match.group(2).upper() if match else None
    if not match or unit not in _UNITS:
        raise UsageError(f"invalid size {text!r}: use a number with B, KB, MB, GB or KiB, MiB, GiB")
    return int(float(match.group(1)) * _UNITS[unit])


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


def format_size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"
