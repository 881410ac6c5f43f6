"""The zoo models, generated once per test session, and script-mode chats on them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from chat_helpers import run_exokv

from exokv.model import zoo

FAMILIES = list(zoo.FAMILIES)

# A message several 32-token sliding windows long (the families that have one), as a
# pasted paragraph is: /retry after it must reuse all of it (RETRIED).
LONG_MESSAGE = (
    "And what about tomorrow in London? I am taking the early train from the north "
    "station, then a bus along the river to the museum, and I would like to know "
    "whether to bring a coat, an umbrella or both, and when the rain should stop."
)
# Two sessions, a /retry and a switch back: turn 2, the retry and the switch-back
# turn must all be served partly from the cache. The prompts cross the 32-token
# sliding window of the families that have one.
SCRIPT = [
    "/new a",
    "Hello there, tell me about the weather in Paris today",
    LONG_MESSAGE,
    "/retry",
    "/new b",
    "A question about cooking pasta",
    "/switch a",
    "One more thing about Paris: is it sunny?",
]
CACHED_TURNS = (1, 2, 4)  # indexes of the turns above that must hit the cache
RETRIED = 2  # the /retry: its whole prompt but the token decode runs is cached

_generated: dict[str, Path] = {}


def zoo_models(factory: pytest.TempPathFactory) -> Path:
    """EXOKV_HOME/models holding every zoo model, generated once per session."""
    if "models" not in _generated:
        home = factory.mktemp("zoo-home")
        code = "from exokv.model import zoo\nfor n in zoo.zoo_names(): zoo.ensure_zoo(n)"
        subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "EXOKV_HOME": str(home)},
            check=True,
            timeout=180,
        )
        _generated["models"] = home / "models"
    return _generated["models"]


def zoo_chat(
    home: Path, model: str, *extra: str, lines: list[str] | None = None
) -> tuple[int, list[dict[str, Any]], str]:
    """(exit code, the turns' JSON objects, stderr) of one script-mode chat."""
    proc = run_exokv(
        ["chat", "--model", model, "--json", "--max-tokens", "8", *extra],
        home,
        "\n".join(lines or SCRIPT) + "\n",
    )
    docs = [json.loads(line) for line in proc.stdout.decode().splitlines() if line.strip()]
    return proc.returncode, [d for d in docs if "turn" in d], proc.stderr.decode()


def replies(turns: list[dict[str, Any]]) -> list[str]:
    return [t["reply"] for t in turns]
