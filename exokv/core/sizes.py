"""Byte sizes: parsing the ones users type (`2GB`, `64MiB`) and writing them for people."""

from __future__ import annotations

import re
from typing import Literal

from exokv.errors import UsageError

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
_SHOWN = ("B", "KB", "MB", "GB", "TB")


def parse_size(text: str) -> int:
    """'2GB' -> 2_000_000_000; '64MiB' -> 67_108_864. Raises UsageError."""
    match = _SIZE.match(text)
    unit = match.group(2).upper() if match else None
    if not match or unit not in _UNITS:
        raise UsageError(f"invalid size {text!r}: use a number with B, KB, MB, GB or KiB, MiB, GiB")
    return int(float(match.group(1)) * _UNITS[unit])


def format_size(
    n: float | None, style: Literal["compact", "decimal"] = "compact", unit: str | None = None
) -> str:
    """Bytes in decimal units; None is `-`.

    compact (table cells, the chat's lines): three digits at most, `512 B`, `4.1 KB`,
    `557 KB`, `23 GB`. decimal (sentences, `exokv models`): one decimal above bytes,
    `557.1 KB`. `unit` ("MB"): always that unit with one decimal, for figures read
    side by side.
    """
    if n is None:
        return "-"
    value = float(n)
    if unit is not None:
        return f"{value / 1000 ** _SHOWN.index(unit):.1f} {unit}"
    # compact rounds to three digits, so 999.7 must already move up a unit
    limit = 999.5 if style == "compact" else 1000
    for shown in _SHOWN:
        if abs(value) < limit or shown == "TB":
            if shown == "B" or (style == "compact" and abs(value) >= 9.95):
                return f"{value:.0f} {shown}"
            return f"{value:.1f} {shown}"
        value /= 1000
    raise AssertionError("unreachable: TB ends the loop")
