"""SmolLM2-135M-Instruct (4-bit, a tied 8-bit embedding, float32 norms) on several
ranks: replies equal one rank's at temperature 0 (issue 18).

Few and short: each rank loads the model and decodes at a few tokens/s here. One
one-rank run is the reference for both: tensor parallel (9 heads, 3 KV heads: -n 3
divides them) runs the script's first two turns, which are the same chat.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from zoo_helpers import replies, zoo_chat

pytestmark = pytest.mark.slow  # starts ranks, servers or real models: see tests/conftest.py

# Two sessions, with /retry, /switch and /undo: six turns, all but the first partly
# served from the cache (session b shares the system prompt's tokens with a).
SCRIPT = [
    "/new a",
    "What is the capital of France?",
    "Name one river in that country.",
    "/new b",
    "What is two plus two?",
    "/retry",
    "/switch a",
    "And the capital of Italy?",
    "/undo",
    "And the capital of Spain?",
]
SHORT = SCRIPT[:3]
MAX_TOKENS = "6"

_runs: list[list[dict[str, Any]]] = []  # the one-rank run, made once per worker


def _chat(home: Path, model: Path, lines: list[str], *args: str) -> list[dict[str, Any]]:
    code, turns, err = zoo_chat(home, str(model), *args, lines=lines)
    assert code == 0, err
    # zoo_chat's --max-tokens 8 is overridden: the last flag wins.
    return turns


def one_rank(model: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """SCRIPT on one rank, run once: a shorter script's turns are its first ones."""
    if not _runs:
        home = tmp_path_factory.mktemp("one")
        _runs.append(_chat(home, model, SCRIPT, "--max-tokens", MAX_TOKENS))
    return _runs[0]


@pytest.mark.timeout(280)
def test_pipeline_ranks_on_an_uneven_split_equal_one_rank(
    smollm2_dir: Path, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """One uneven split (20 and 10 layers): the even default runs the same path, and
    runs on the zoo families too."""
    one = one_rank(smollm2_dir, tmp_path_factory)
    args = ["-n", "2", "--max-tokens", MAX_TOKENS, "--starting-port", "25620", "--split", "20,10"]
    two = _chat(tmp_path, smollm2_dir, SCRIPT, *args)
    assert len(two) == 6 and all(t["ranks"] == 2 for t in two)
    assert replies(two) == replies(one)
    assert "Paris" in two[0]["reply"]
    assert all(t["finish_reason"] != "interrupted" for t in two)
    assert two[0]["cached_tokens"] == 0
    assert all(t["cached_tokens"] > 0 for t in two[1:])
    assert [t["cached_tokens"] for t in two] == [t["cached_tokens"] for t in one]


@pytest.mark.timeout(280)
def test_tensor_parallel_on_three_ranks_equals_one_rank(
    smollm2_dir: Path, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    one = one_rank(smollm2_dir, tmp_path_factory)[:2]
    args = ("-n", "3", "--parallel", "tensor", "--max-tokens", MAX_TOKENS)
    three = _chat(tmp_path, smollm2_dir, SHORT, *args, "--starting-port", "25640")
    assert len(three) == 2 and all(t["ranks"] == 3 for t in three)
    assert replies(three) == replies(one)
    assert three[1]["cached_tokens"] > 0
    assert [t["cached_tokens"] for t in three] == [t["cached_tokens"] for t in one]
