"""Models from the hub: `--model org/name` fetched from a stand-in hub (tests/hub_standin.py).

The stand-in serves builtin:llama-tiny as `acme/llama-tiny`, one shard per layer
plus one for the tensors outside the layers, so which shards a host holds shows
which layers it loads.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hub_standin import COMMIT, DRAFT_REPO, NON_LAYER_SHARD, REPO, StandinHub, layer_shard, standin

from exokv.model import hub

SCRIPT = ["Hello there", "Tell me about the sea"]


# -- which files a host fetches (pure) --------------------------------------------------


def test_a_repo_id_with_a_revision_is_parsed() -> None:
    assert hub.parse_name("acme/x") == ("acme/x", None)
    assert hub.parse_name("acme/x@v1.2") == ("acme/x", "v1.2")
    assert hub.parse_name("acme/x@refs/pr/1") == ("acme/x", "refs/pr/1")
    for bad in ("acme", "acme/x@", "builtin:tiny", "a/b/c", "/abs/path"):
        assert hub.parse_name(bad) is None, bad


def test_pipeline_rank_0_runs_the_last_layers() -> None:
    assert list(hub.rank_layers(4, [3, 1], 2, 0)) == [1, 2, 3]
    assert list(hub.rank_layers(4, [3, 1], 2, 1)) == [0]
    assert list(hub.rank_layers(5, None, 2, 0)) == [2, 3, 4]  # even split, rank 0 the extra
    assert list(hub.rank_layers(5, None, 2, 1)) == [0, 1]


def test_each_host_needs_its_layers_shards_and_the_shared_ones() -> None:
    weight_map = {"model.embed_tokens.weight": "s0", "model.norm.weight": "s0"}
    weight_map |= {"lm_head.weight": "s9"}
    weight_map |= {f"model.layers.{n}.mlp.up_proj.weight": f"s{n + 1}" for n in range(4)}
    files = ["config.json", "tokenizer.json", "README.md", "s0", "s1", "s2", "s3", "s4", "s9"]
    files = [f if f.endswith((".json", ".md")) else f"model-{f}.safetensors" for f in files]
    weight_map = {k: f"model-{v}.safetensors" for k, v in weight_map.items()}
    config = {"num_hidden_layers": 4}
    mine = hub.host_layers(config, weight_map, [3, 1], 2, [1], "pipeline")
    assert mine == {0}
    assert hub.files_for(files, weight_map, mine) == [
        "config.json",
        "model-s0.safetensors",  # embedding and norm: every rank computes the logits
        "model-s1.safetensors",
        "model-s9.safetensors",  # the head
        "tokenizer.json",
    ]
    # Tensor parallel, one rank, or both ranks on one host: every weight file.
    every = [f for f in files if f != "README.md"]
    assert hub.host_layers(config, weight_map, None, 2, [0], "tensor") is None
    assert hub.files_for(files, weight_map, None) == sorted(every)
    both = hub.host_layers(config, weight_map, [3, 1], 2, [0, 1], "pipeline")
    assert hub.files_for(files, weight_map, both) == sorted(every)
    # No index (one model.safetensors): that file.
    assert hub.files_for(["config.json", "model.safetensors"], None, {0}) == [
        "config.json",
        "model.safetensors",
    ]
    # A split that does not fit the model: all of it (the ranks' loading says why).
    assert hub.host_layers(config, weight_map, [2, 1], 2, [0], "pipeline") is None


# -- against the stand-in ---------------------------------------------------------------


@pytest.fixture(scope="module")
def standin_hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StandinHub]:
    served = standin(tmp_path_factory.mktemp("hub")).start()
    yield served
    served.stop()


def _env(hf_home: Path, hub_url: str, **extra: str) -> dict[str, str]:
    env = {**os.environ, "HF_HOME": str(hf_home), "HF_ENDPOINT": hub_url, **extra}
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HUB_OFFLINE", "EXOKV_DEBUG"):
        if name not in extra:
            env.pop(name, None)
    return env


def _chat(home: Path, env: dict[str, str], model: str, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "exokv", "chat", "--model", model, "--json"]
        + ["--max-tokens", "8", *extra],
        input="\n".join(SCRIPT) + "\n",
        capture_output=True,
        text=True,
        env={**env, "EXOKV_HOME": str(home)},
        timeout=150,
    )


def _turns(proc: subprocess.CompletedProcess) -> list[dict[str, Any]]:
    assert proc.returncode == 0, proc.stderr
    return [json.loads(x) for x in proc.stdout.splitlines() if x.strip()]


def _one_line(proc: subprocess.CompletedProcess) -> str:
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    return lines[0]


def _snapshot(hf_home: Path) -> Path:
    return hf_home / "hub" / "models--acme--llama-tiny" / "snapshots" / COMMIT


def _held(hf_home: Path) -> list[str]:
    return sorted(p.name for p in _snapshot(hf_home).iterdir())


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_chat_downloads_the_model_then_answers_from_the_cache(tmp_path: Path) -> None:
    served = standin(tmp_path / "hub").start()
    hf_home = tmp_path / "hf"
    try:
        first = _chat(tmp_path / "h1", _env(hf_home, served.url), REPO)
        turns = _turns(first)
        assert [t["turn"] for t in turns] == [1, 2] and all(t["reply"] for t in turns)
        # Our line, then huggingface_hub's own progress bars (stderr is not a terminal).
        assert "downloading 5 files (" in first.stderr
        assert f"of {REPO} from {served.url}" in first.stderr
        assert "model-00005-of-00005.safetensors" in first.stderr, first.stderr
        assert served.downloaded() == set(served.files)  # one rank: every file
        assert _held(hf_home) == sorted(served.files)
        # Nothing fetched twice; a hub --draft-model is fetched before the ranks start.
        served.repo_gets.clear()
        again = _chat(tmp_path / "h2", _env(hf_home, served.url), REPO, "--draft-model", DRAFT_REPO)
        assert served.repo_gets == {DRAFT_REPO: len(served.files)}, served.repo_gets
        assert "downloading 5 files (" in again.stderr, again.stderr
        assert f"of {DRAFT_REPO} from {served.url}" in again.stderr
        assert [t["reply"] for t in _turns(again)] == [t["reply"] for t in turns]
        assert sum(t["accepted_tokens"] for t in _turns(again)) > 0  # the model drafting itself
    finally:
        served.stop()
    # The hub gone: the cache answers, with the same replies.
    gone = _chat(tmp_path / "h3", _env(hf_home, served.url), REPO)
    assert [t["reply"] for t in _turns(gone)] == [t["reply"] for t in turns]
    assert "downloading" not in gone.stderr


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_revision_is_fetched_and_a_missing_one_is_named(
    tmp_path: Path, standin_hub: StandinHub
) -> None:
    env = _env(tmp_path / "hf", standin_hub.url)
    turns = _turns(_chat(tmp_path / "h", env, f"{REPO}@v1"))
    assert len(turns) == 2 and all(t["reply"] for t in turns)
    ref = tmp_path / "hf" / "hub" / "models--acme--llama-tiny" / "refs" / "v1"
    assert ref.read_text() == COMMIT
    line = _one_line(_chat(tmp_path / "h", env, f"{REPO}@v9"))
    assert "'v9'" in line and REPO in line and standin_hub.url in line


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_missing_repo_is_one_line_naming_it(tmp_path: Path, standin_hub: StandinHub) -> None:
    line = _one_line(_chat(tmp_path / "h", _env(tmp_path / "hf", standin_hub.url), "acme/nope"))
    assert "acme/nope" in line and "not found" in line and standin_hub.url in line


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_missing_draft_repo_is_one_line_naming_the_flag(
    tmp_path: Path, standin_hub: StandinHub
) -> None:
    env = _env(tmp_path / "hf", standin_hub.url)
    line = _one_line(_chat(tmp_path / "h", env, REPO, "--draft-model", "acme/nope"))
    assert line.startswith("exokv: error: --draft-model acme/nope: "), line
    assert "not found" in line and standin_hub.url in line


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_no_hub_and_nothing_cached_is_one_line(tmp_path: Path) -> None:
    unreachable = "http://127.0.0.1:9"  # discard: nothing listens
    line = _one_line(_chat(tmp_path / "h", _env(tmp_path / "hf", unreachable), REPO))
    assert "cannot reach the hub" in line and unreachable in line and REPO in line
    offline = _env(tmp_path / "hf", unreachable, HF_HUB_OFFLINE="1")
    line = _one_line(_chat(tmp_path / "h", offline, REPO))
    assert "HF_HUB_OFFLINE" in line and REPO in line and "not found" in line


@pytest.fixture
def hf_env(tmp_path: Path, standin_hub: StandinHub, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This process's huggingface_hub pointed at the stand-in, with an empty cache."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_ENDPOINT", standin_hub.url)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    return tmp_path / "hf"


@pytest.mark.timeout(60)
def test_a_connection_cut_mid_file_resumes_from_where_it_stopped(
    hf_env: Path, standin_hub: StandinHub, monkeypatch: pytest.MonkeyPatch
) -> None:
    """huggingface_hub resumes with a Range request from the last whole chunk it wrote
    (10 MB; 16 KB here, so a tiny shard spans several chunks as a real one does)."""
    from huggingface_hub import constants

    chunk = 16 * 1024
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", chunk)
    shard = layer_shard(2)
    body = standin_hub.files[shard]
    standin_hub.cut[shard] = 3 * chunk + 100
    standin_hub.ranges.pop(shard, None)
    got = hub.fetch(REPO, None)
    assert standin_hub.ranges[shard] == [3 * chunk]  # only the rest was sent again
    assert (got.path / shard).read_bytes() == body


@pytest.mark.timeout(60)
def test_a_half_written_file_is_never_used(hf_env: Path, standin_hub: StandinHub) -> None:
    """A download that died leaves a .incomplete blob and no file in the snapshot: the
    loader names the file missing, and the next fetch fetches it whole."""
    from exokv.model.loading import _missing_files

    got = hub.fetch(REPO, None)
    shard = layer_shard(2)
    blob = (got.path / shard).resolve()
    (got.path / shard).unlink()
    blob.unlink()
    body = standin_hub.files[shard]
    blob.with_name(blob.name + ".1234abcd.incomplete").write_bytes(body[: len(body) // 2])
    assert hub.cached_snapshot(REPO, None) == got.path
    assert _missing_files(got.path, ["model.layers.2.mlp.up_proj.weight"]) == [shard]
    again = hub.fetch(REPO, None)
    assert again.fetched == [shard] and again.bytes == len(body)
    assert (got.path / shard).read_bytes() == body


@pytest.mark.timeout(60)
def test_the_standin_answers_get_safetensors_metadata(
    hf_env: Path, standin_hub: StandinHub
) -> None:
    """What the placement reads (per-layer weight bytes) without downloading weights."""
    from huggingface_hub import HfApi

    meta = HfApi(endpoint=standin_hub.url).get_safetensors_metadata(REPO)
    assert meta.sharded and set(meta.files_metadata) == {NON_LAYER_SHARD} | {
        layer_shard(n) for n in range(4)
    }
    assert meta.weight_map["model.layers.3.mlp.up_proj.weight"] == layer_shard(3)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_server_fetches_the_model_before_it_serves(
    tmp_path: Path, standin_hub: StandinHub
) -> None:
    from serve_helpers import raw, serving

    env = _env(tmp_path / "hf", standin_hub.url)
    with serving(tmp_path / "h", "--model", REPO, env=env) as server:
        assert any(f"of {REPO} from {standin_hub.url}" in x for x in server.log), server.log
        body = {"model": REPO, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        status, _, answer = raw(server.base + "/chat/completions", json.dumps(body).encode())
    assert status == 200 and answer["choices"][0]["message"]["content"], answer
    assert _held(tmp_path / "hf") == sorted(standin_hub.files)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_dry_run_says_what_a_host_would_fetch(hf_env: Path, standin_hub: StandinHub) -> None:
    """`python -m exokv.model.fetcher --dry-run`, as `hosts check` can run it on a host."""
    from exokv.model import fetcher

    args = ["--model", REPO, "--ranks", "2", "--host-ranks", "1", "--split", "3,1", "--dry-run"]
    standin_hub.gets.clear()
    out = subprocess.run(
        [sys.executable, "-c", f"from exokv.model.fetcher import main; main({args!r})"],
        capture_output=True,
        text=True,
        env={**os.environ},
        timeout=60,
    )
    done = json.loads(out.stdout.splitlines()[-1])
    would = [NON_LAYER_SHARD, layer_shard(0)]
    assert done["event"] == "done" and done["fetched"] == would, out
    assert done["bytes"] == sum(len(standin_hub.files[f]) for f in would)
    assert not any(f.endswith(".safetensors") for f in standin_hub.downloaded())
    assert fetcher.main(["--model", "not a repo"]) == 1


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_plan_for_a_repo_not_downloaded_reads_only_headers(
    tmp_path: Path, standin_hub: StandinHub
) -> None:
    """`--plan` on a hub repo nothing of which is here: the layer sizes come from the
    shards' headers (Range requests), no weight is downloaded, and they are kept, so the
    next plan asks the hub nothing."""
    env = {**_env(tmp_path / "hf", standin_hub.url), "EXOKV_TEST_HOST_MEMORY": "24GB,8GB"}
    standin_hub.gets.clear()
    standin_hub.ranges.clear()

    def plan_once() -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "exokv", "chat", "--model", REPO, "-n", "2", "--plan", "--json"],
            capture_output=True,
            text=True,
            env={**env, "EXOKV_HOME": str(tmp_path / "h")},
            timeout=100,
        )

    proc = plan_once()
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    assert plan["split"] == [3, 1] and plan["source"] == "auto", plan
    weights = {f for f in standin_hub.files if f.endswith(".safetensors")}
    assert weights <= set(standin_hub.ranges), standin_hub.ranges  # every header read
    assert all(start == 0 for f in weights for start in standin_hub.ranges[f])
    fetched = sum(standin_hub.gets[f] for f in weights) - sum(
        len(standin_hub.ranges[f]) for f in weights
    )
    assert fetched == 0, standin_hub.gets  # no whole shard
    standin_hub.ranges.clear()
    again = plan_once()
    assert again.returncode == 0 and json.loads(again.stdout) == plan, again.stderr
    assert not standin_hub.ranges  # the headers' sizes were kept
