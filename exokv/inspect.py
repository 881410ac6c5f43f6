"""`exokv cache ...`: read the state store and render tables or JSON."""

from __future__ import annotations

import typer

cache_app = typer.Typer(help="Inspect the prefix cache: stats, entries, pressure, evictions.")
