"""Running `exokv` as a user would: a subprocess with its own EXOKV_HOME."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any


def run_exokv(
    args: list[str],
    home: Path,
    stdin: str | bytes = b"",
    timeout: float = 180,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[bytes]:
    full_env = {**os.environ, "EXOKV_HOME": str(home), **(env or {})}
    full_env.pop("EXOKV_DEBUG", None)
    data = stdin.encode() if isinstance(stdin, str) else stdin
    return subprocess.run(
        [sys.executable, "-m", "exokv", *args],
        input=data,
        capture_output=True,
        timeout=timeout,
        env=full_env,
    )


def chat_json(
    lines: list[str], home: Path, *extra: str, env: dict[str, str] | None = None
) -> list[dict[str, Any]]:
    """A script-mode chat on builtin:tiny; returns the per-turn JSON objects."""
    proc = run_exokv(
        ["chat", "--model", "builtin:tiny", "--json", "--max-tokens", "12", *extra],
        home,
        "\n".join(lines) + "\n",
        env=env,
    )
    assert proc.returncode == 0, proc.stderr.decode()
    docs = [json.loads(line) for line in proc.stdout.decode().splitlines() if line.strip()]
    return [d for d in docs if "turn" in d]


def home_with_models(path: Path, models: Path, link: bool = False) -> Path:
    """A fresh EXOKV_HOME holding the session's generated builtin models."""
    path.mkdir(parents=True, exist_ok=True)
    if link:
        (path / "models").symlink_to(models, target_is_directory=True)
    else:
        shutil.copytree(models, path / "models")
    return path


def exokv_text(
    home: Path, *args: str, stdin: str | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """`exokv ARGS` with text output; no stdin unless given, so nothing waits for a terminal."""
    env = {**os.environ, "EXOKV_HOME": str(home)}
    env.pop("EXOKV_DEBUG", None)
    return subprocess.run(
        [sys.executable, "-c", "from exokv.cli import main; main()", *args],
        env=env,
        input=stdin,
        stdin=None if stdin is not None else subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def cache_json(home: Path, *args: str) -> dict[str, Any]:
    """`exokv cache ARGS --json`, which must succeed, as a document."""
    proc = exokv_text(home, "cache", *args, "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)
