"""The zoo models in process: generation, replies, what `exokv models` says, the guards."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from chat_helpers import home_with_models, run_exokv
from mlx_lm.generate import generate_step
from rich.console import Console
from zoo_helpers import FAMILIES, zoo_models

from exokv.core.records import TurnRequest
from exokv.errors import ExokvError
from exokv.hosts.placement import even_split, local_range
from exokv.model import zoo
from exokv.model.catalogue import models_table
from exokv.model.resolve import load_model
from exokv.rank.main import in_step
from exokv.wire.messages import Shutdown, Turn, encode

# What each family is, from mlx-lm's own classes: cache kind, pipeline, tensor.
EXPECTED = {
    "llama": ("llama", "slices", "generic", True),
    "qwen3": ("qwen3", "slices", "generic", True),
    "qwen3-moe": ("qwen3_moe", "slices", "mlx-lm", True),
    "gemma3": ("gemma3_text", "mixed", "generic", False),
    "gpt-oss": ("gpt_oss", "mixed", "generic", True),
    "ministral3": ("ministral3", "mixed", "mlx-lm", True),
    "deepseek-v3": ("deepseek_v3", "slices", "mlx-lm", True),
    "qwen3-next": ("qwen3_next", "mixed", "mlx-lm", False),
}
PROMPTS = ["Hello! How are you today?", "Tell me a story about the sea", "What is a cache?"]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return zoo_models(tmp_path_factory)


def _greedy(model, tokenizer, text: str, n: int = 10) -> list[int]:
    import mlx.core as mx

    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True
    )
    steps = generate_step(mx.array(prompt), model, max_tokens=n)
    return [int(t) for t, _ in steps]


def test_every_family_has_an_expectation() -> None:
    assert set(EXPECTED) == set(FAMILIES) and len(FAMILIES) >= 8


@pytest.mark.parametrize("family", FAMILIES)
def test_replies_depend_on_the_prompt(
    family: str, models: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EXOKV_HOME", str(home_with_models(tmp_path, models, link=True)))
    model, tokenizer = load_model(f"builtin:{family}-tiny")
    assert len(model.layers) >= 4
    replies = [_greedy(model, tokenizer, p) for p in PROMPTS]
    assert len({tuple(r) for r in replies}) == len(replies), replies
    assert all(len(set(r)) > 2 for r in replies), replies  # not one token repeated
    assert _greedy(model, tokenizer, PROMPTS[0]) == replies[0]


def test_generation_is_deterministic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fingerprints = []
    for home in ("one", "two"):
        monkeypatch.setenv("EXOKV_HOME", str(tmp_path / home))
        zoo.ensure_zoo("gemma3-tiny")
        fingerprints.append(zoo.read_zoo_marker("gemma3-tiny")["fingerprint"])
    assert fingerprints[0] == fingerprints[1]
    config = json.loads((tmp_path / "one" / "models" / "gemma3-tiny" / "config.json").read_text())
    assert config["model_type"] == "gemma3_text" and config["sliding_window"] <= 64


@pytest.mark.slow
def test_models_json_gives_family_cache_kind_pipeline_tensor(models: Path, tmp_path: Path) -> None:
    proc = run_exokv(["models", "--json"], home_with_models(tmp_path, models, link=True))
    assert proc.returncode == 0, proc.stderr.decode()
    found = {m["name"]: m for m in json.loads(proc.stdout)}
    for family, (model_type, cache_kind, kind, tensor) in EXPECTED.items():
        entry = found[f"builtin:{family}-tiny"]
        assert entry["kind"] == "zoo" and entry["generated"], entry
        got = (entry["family"], entry["cache_kind"], entry["pipeline"], entry["tensor"])
        assert got == (model_type, cache_kind, kind, tensor), family
    assert found["builtin:tiny"]["cache_kind"] == "slices"
    assert found["builtin:tiny"]["pipeline"] == "mlx-lm"


def test_models_table_fits_80_columns_without_cutting_a_name() -> None:
    long_name = "mlx-community/Llama-3.3-70B-Instruct-4bit"
    rows = [
        {"name": long_name, "family": "llama", "cache_kind": "slices", "pipeline": "generic"},
        {"name": "builtin:deepseek-v3-tiny", "family": "deepseek_v3", "cache_kind": "mixed"},
    ]
    rows[0].update(tensor=True, size_bytes=40 * 2**30)
    rows[1].update(pipeline="mlx-lm", tensor=False, size_bytes=None)
    out = io.StringIO()
    Console(file=out, width=80).print(models_table(rows))
    lines = out.getvalue().splitlines()
    assert all(len(line) <= 80 for line in lines), lines
    assert any(long_name in line for line in lines)
    assert any("builtin:deepseek-v3-tiny" in line for line in lines)


@pytest.mark.parametrize("split", [[2, 2], [3, 1], [1, 3], [2, 1, 1]])
def test_generic_split_follows_mlx_lm_convention(split: list[int]) -> None:
    # mlx-lm's PipelineMixin on a stand-in group: rank 0 runs the last layers.
    from mlx_lm.models.pipeline import PipelineMixin

    class Group:
        def __init__(self, rank: int) -> None:
            self._rank = rank

        def rank(self) -> int:
            return self._rank

        def size(self) -> int:
            return len(split)

    for rank in range(len(split)):
        mixin = PipelineMixin()
        mixin.layers = list(range(sum(split)))
        mixin.pipeline(Group(rank), split)
        assert local_range(split, rank) == (mixin.start_idx, mixin.end_idx)
    assert even_split(5, 2) == [3, 2]


class _Peer:
    """One rank's view of the per-turn broadcast: rank 0's stamped message."""

    rank = 1
    size = 2

    def __init__(self, got: object) -> None:
        self.got = got

    def broadcast(self, obj: object) -> object:
        if isinstance(self.got, Exception):
            raise self.got
        return self.got


def test_a_rank_out_of_step_stops_with_one_line() -> None:
    ok = {"type": "shutdown", "step": 3, "turn_no": 1}
    assert in_step(_Peer(ok), None, 3, 1) == Shutdown()
    with pytest.raises(ExokvError) as info:
        in_step(_Peer({"type": "shutdown", "step": 2, "turn_no": 1}), None, 3, 1)
    message = str(info.value)
    assert "\n" not in message and "out of step" in message and "expected message 3" in message
    with pytest.raises(ExokvError) as info:
        in_step(_Peer(UnicodeDecodeError("utf-8", b"\xff", 0, 1, "bad")), None, 3, 1)
    assert "did not decode" in str(info.value)


def test_rank_zero_stamps_its_messages() -> None:
    class Zero(_Peer):
        rank = 0

        def broadcast(self, obj: object) -> object:
            stamped.append(obj)
            return obj

    stamped: list[object] = []
    turn = Turn(1, TurnRequest("s", []))
    got = in_step(Zero(None), turn, 5, 2)
    assert stamped == [{**encode(turn), "step": 5, "turn_no": 2}] and got == turn


def test_missing_weights_refused_in_process(
    models: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shutil

    partial = tmp_path / "m"
    shutil.copytree(models / "gpt-oss-tiny", partial)
    index = json.loads((partial / "model.safetensors.index.json").read_text())
    lost = index["weight_map"]["lm_head.weight"]
    (partial / lost).unlink()
    monkeypatch.setenv("EXOKV_HOME", str(tmp_path / "home"))
    with pytest.raises(ExokvError) as info:
        load_model(str(partial))
    message = str(info.value)
    assert "\n" not in message and lost in message and "random weights" in message
