"""Every zoo family through the chat: cache vs --no-cache, one rank vs two, tensor.

Each family runs the same script (two sessions, a /retry, a switch back) on one
rank with the cache, on one rank without it, and on two pipeline ranks (a split
chosen to put a family's layer kinds on different ranks); replies at temp 0 must
be the same in all three. Tensor parallel must equal one rank where mlx-lm can
shard the family and be a usage error where it cannot.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from chat_helpers import home_with_models, run_exokv
from zoo_helpers import CACHED_TURNS, FAMILIES, RETRIED, replies, zoo_chat, zoo_models

from exokv.model import zoo
from exokv.model.families import supports_tensor

pytestmark = pytest.mark.slow  # starts ranks, servers or real models: see tests/conftest.py

# None: the even split of `-n 2 --parallel pipeline` (llama's is the README's own
# example). Otherwise an uneven one that leaves a rank without one layer kind:
# gemma3 3,1 puts its global layer (2) in the middle of rank 0's slice; gpt-oss 3,1
# leaves rank 1 with only a sliding layer; qwen3-next 3,1 leaves rank 1 with only
# linear-attention layers. UNEVEN_KINDS adds the other way round for gpt-oss.
SPLITS: dict[str, str | None] = {
    "llama": None,
    "qwen3": "3,1",
    "qwen3-moe": "1,3",
    "gemma3": "3,1",
    "gpt-oss": "3,1",
    "ministral3": "3,1",
    "deepseek-v3": "1,3",
    "qwen3-next": "3,1",
}
# A rank whose layers are all KVCache beside one that holds sliding layers (gpt-oss
# 1,3): the ranks must still agree on every storage class (cache/coordinate.py).
UNEVEN_KINDS = [("gpt-oss", "1,3")]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return zoo_models(tmp_path_factory)


@pytest.fixture(scope="module")
def one_rank(models: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Any]:
    """The one-rank, cached run of SCRIPT per family, run once and shared."""
    runs: dict[str, list[dict[str, Any]]] = {}

    def get(family: str) -> list[dict[str, Any]]:
        if family not in runs:
            home = home_with_models(tmp_path_factory.mktemp(f"one-{family}"), models, link=True)
            code, turns, err = zoo_chat(home, f"builtin:{family}-tiny")
            assert code == 0, err
            runs[family] = turns
        return runs[family]

    return get


def _home(path: Path, models: Path) -> Path:
    return home_with_models(path, models, link=True)


def _port(family: str, offset: int) -> str:
    return str(27000 + 20 * FAMILIES.index(family) + offset)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("family", FAMILIES)
def test_cache_no_cache_and_pipeline_agree(
    family: str, models: Path, one_rank: Callable[[str], Any], tmp_path: Path
) -> None:
    model = f"builtin:{family}-tiny"
    hot = one_rank(family)
    assert len(hot) == 5 and all(t["ranks"] == 1 for t in hot)
    for i in CACHED_TURNS:
        assert hot[i]["cached_tokens"] > 0, (i, hot[i])
    assert hot[RETRIED]["command"] == "/retry"
    assert hot[RETRIED]["reply"] == hot[RETRIED - 1]["reply"]
    # /retry after a long message reuses all its prompt, sliding windows and states too
    # (the turn stored a point at its prompt's end); two ranks below cache the same.
    retry = hot[RETRIED]
    assert retry["cached_tokens"] == retry["prompt_tokens"] - 1 > 100, retry
    # The replies depend on the prompt: a degenerate model would prove nothing.
    assert len(set(replies(hot))) >= 3 and all(len(set(r)) > 2 for r in replies(hot))

    split = SPLITS[family]
    extra = ["-n", "2", "--parallel", "pipeline", "--starting-port", _port(family, 0)]
    extra += ["--split", split] if split else []
    two_model = model
    if family == GLOB_FAMILY:  # test_glob_characters_in_the_path_..., on two ranks
        two_model = str(_glob_copy(tmp_path / "glob", models, family))
    # The two runs are independent: side by side, they share the machine's two cores.
    with ThreadPoolExecutor(2) as pool:
        cold_run = pool.submit(zoo_chat, _home(tmp_path / "cold", models), model, "--no-cache")
        two_run = pool.submit(zoo_chat, _home(tmp_path / "two", models), two_model, *extra)
        (code, cold, err), (code2, two, err2) = cold_run.result(), two_run.result()
    assert code == 0, err
    assert replies(cold) == replies(hot)
    assert all(t["cached_tokens"] == 0 for t in cold)

    assert code2 == 0, err2
    assert replies(two) == replies(hot)
    assert [t["cached_tokens"] for t in two] == [t["cached_tokens"] for t in hot]
    assert all(t["ranks"] == 2 for t in two)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("family", FAMILIES)
def test_tensor_parallel_or_usage_error(
    family: str, models: Path, one_rank: Callable[[str], Any], tmp_path: Path
) -> None:
    config = zoo.zoo_config(f"{family}-tiny")
    home = home_with_models(tmp_path / "h", models, link=True)
    args = ["-n", "2", "--parallel", "tensor", "--starting-port", _port(family, 10)]
    start = time.monotonic()
    code, turns, err = zoo_chat(home, f"builtin:{family}-tiny", *args)
    if supports_tensor(config):
        assert code == 0, err
        assert replies(turns) == replies(one_rank(family))
        assert all(t["ranks"] == 2 for t in turns)
    else:
        lines = [line for line in err.splitlines() if line.strip()]
        assert code == 2 and len(lines) == 1, err
        assert "--parallel pipeline" in lines[0] and config["model_type"] in lines[0]
        assert turns == []
        assert time.monotonic() - start < 30  # refused before any rank was launched


# mlx-lm finds weight files with a glob on the model path: under `b[1]` it found
# none, and the sharded loader (strict=False) ran every rank on random weights. The
# two-rank case is GLOB_FAMILY's pipeline run in test_cache_no_cache_and_pipeline_agree
# (its model given as a path under such a folder): one set of ranks, not two.
GLOB_FAMILY = "llama"


def _glob_copy(root: Path, models: Path, family: str) -> Path:
    """A copy of the family's model under a folder whose name holds glob characters."""
    model = root / "b[1]*?" / "home" / "models" / f"{family}-tiny"
    shutil.copytree(models / f"{family}-tiny", model)
    return model


@pytest.mark.timeout(180)
def test_glob_characters_in_the_path_load_on_one_rank(
    models: Path, one_rank: Callable[[str], Any], tmp_path: Path
) -> None:
    home = _glob_copy(tmp_path, models, GLOB_FAMILY).parents[1]
    code, turns, err = zoo_chat(home, f"builtin:{GLOB_FAMILY}-tiny")
    assert code == 0, err
    assert replies(turns) == replies(one_rank(GLOB_FAMILY))


@pytest.mark.timeout(180)
def test_a_missing_weight_file_is_refused_on_every_rank_count(models: Path, tmp_path: Path) -> None:
    partial = tmp_path / "partial-llama"
    shutil.copytree(models / "llama-tiny", partial)
    index = json.loads((partial / "model.safetensors.index.json").read_text())
    lost = index["weight_map"]["model.layers.1.mlp.down_proj.weight"]
    (partial / lost).unlink()
    home = tmp_path / "home"
    home.mkdir()
    # With -n 2 (even split) layer 1 is rank 1's: rank 0 has every file it needs.
    for extra in ([], ["-n", "2", "--starting-port", "27220"]):
        code, turns, err = zoo_chat(home, str(partial), *extra, lines=["Hello there"])
        lines = [line for line in err.splitlines() if line.strip()]
        assert code == 1 and len(lines) == 1, (extra, err)
        assert lost in lines[0] and "random weights" in lines[0], lines[0]
        assert turns == []


@pytest.mark.timeout(180)
@pytest.mark.parametrize("family", ["gemma3", "llama"])  # sliding-window and dense
def test_bench_runs_on_a_zoo_path(family: str, models: Path, tmp_path: Path) -> None:
    home = home_with_models(tmp_path / "h", models, link=True)
    path = str(models / f"{family}-tiny")
    args = ["bench", "--model", path, "--scenario", "linear", "--turns", "3", "--context", "300"]
    args += ["--reply-tokens", "8"]  # not 32: equal replies need no long ones
    proc = run_exokv([*args, "--json"], home)
    assert proc.returncode == 0, proc.stderr.decode()
    doc = json.loads(proc.stdout)
    assert doc["replies_match"], doc["mismatches"]
    turns = doc["scenarios"]["linear"]["turns"]
    assert len(turns) == 3 and turns[1]["strategies"]["exokv"]["cached_tokens"] > 0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("family, split", UNEVEN_KINDS)
def test_ranks_holding_different_layer_kinds_agree(
    family: str, split: str, models: Path, one_rank: Callable[[str], Any], tmp_path: Path
) -> None:
    port = _port(family, 15)
    args = ("-n", "2", "--split", split, "--starting-port", port)
    home = home_with_models(tmp_path / "h", models, link=True)
    code, turns, err = zoo_chat(home, f"builtin:{family}-tiny", *args)
    assert code == 0, err
    assert replies(turns) == replies(one_rank(family))
