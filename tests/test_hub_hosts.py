"""A hub model onto two ssh hosts with their own homes: each fetches only its layers' shards.

The hosts of tests/ssh_hosts.py each have their own HOME, so their own Hugging Face
cache (~/.cache/huggingface); the hostfile's envs point them at the stand-in hub
(tests/hub_standin.py), which serves llama-tiny with one shard per layer.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hub_standin import (
    COMMIT,
    DRAFT_REPO,
    NON_LAYER_SHARD,
    REPO,
    StandinHub,
    layer_shard,
    standin,
)
from ssh_hosts import HOSTS, SshHosts

pytestmark = pytest.mark.slow  # starts ranks, servers or real models: see tests/conftest.py

SCRIPT = ["Hello there", "Tell me about the sea"]
META = {
    "config.json",
    "generation_config.json",
    "model.safetensors.index.json",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
}


@pytest.fixture(scope="module")
def standin_hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StandinHub]:
    served = standin(tmp_path_factory.mktemp("hub")).start()
    yield served
    served.stop()


def _env(tmp_path: Path, ssh_hosts: SshHosts, hub_url: str, hf: str) -> dict[str, str]:
    env = ssh_hosts.env(HF_HOME=str(tmp_path / hf), HF_ENDPOINT=hub_url)
    env["EXOKV_HOME"] = str(tmp_path / f"home-{hf}")
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HUB_OFFLINE", "EXOKV_DEBUG"):
        env.pop(name, None)
    return env


def _hostfile(path: Path, hub_url: str, names: list[str]) -> Path:
    hosts = [{"ssh": name, **({"ips": [HOSTS[name]]} if name in HOSTS else {})} for name in names]
    path.write_text(json.dumps({"hosts": hosts, "envs": [f"HF_ENDPOINT={hub_url}"]}))
    return path


def _run(env: dict[str, str], *args: str, stdin: str = "") -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "exokv", *args],
        input=stdin,
        capture_output=True,
        text=True,
        env=env,
        timeout=200,
    )


def _chat(env: dict[str, str], *extra: str) -> tuple[list[dict[str, Any]], str]:
    proc = _run(
        env,
        *("chat", "--model", REPO, "--json", "--max-tokens", "8", *extra),
        stdin="\n".join(SCRIPT) + "\n",
    )
    assert proc.returncode == 0, proc.stderr
    return [json.loads(x) for x in proc.stdout.splitlines() if x.strip()], proc.stderr


def _held(home: Path, repo: str = REPO, cache: str = ".cache/huggingface/hub") -> set[str]:
    """The files of `repo` in the Hugging Face cache under `home`."""
    snapshot = home / cache / f"models--{repo.replace('/', '--')}" / "snapshots" / COMMIT
    return {p.name for p in snapshot.iterdir()}


@pytest.mark.timeout(600)
def test_each_host_fetches_only_the_shards_of_its_layers(
    tmp_path: Path, ssh_hosts: SshHosts, standin_hub: StandinHub
) -> None:
    reference, _ = _chat(_env(tmp_path, ssh_hosts, standin_hub.url, "hf-ref"))
    hostfile = _hostfile(tmp_path / "hosts.json", standin_hub.url, list(HOSTS))
    front = _env(tmp_path, ssh_hosts, standin_hub.url, "hf-front")
    args = ("--hostfile", str(hostfile), "--split", "3,1")
    standin_hub.gets.clear()
    turns, err = _chat(front, *args, "--starting-port", "26560")
    assert [t["reply"] for t in turns] == [t["reply"] for t in reference], err
    assert all(t["ranks"] == 2 for t in turns)
    assert "exokv-a: fetching 4 files" in err and "exokv-b: fetching 2 files" in err, err
    # Rank 0 (exokv-a) runs the last three layers, rank 1 (exokv-b) the first one; both
    # hold the embedding, norm and head (every rank computes the logits).
    a, b = (ssh_hosts.homes[name] for name in HOSTS)
    assert _held(a) == META | {NON_LAYER_SHARD, layer_shard(1), layer_shard(2), layer_shard(3)}
    assert _held(b) == META | {NON_LAYER_SHARD, layer_shard(0)}
    assert _held(tmp_path / "hf-front", REPO, "hub") == META  # it tokenizes; no weights

    # The next chat downloads nothing of the model; a hub --draft-model goes whole onto
    # rank 0's host alone (rank 0 drafts), its tokenizer onto the front end.
    standin_hub.gets.clear()
    standin_hub.repo_gets.clear()
    drafted = ("--draft-model", DRAFT_REPO, "--starting-port", "26570")
    again, err = _chat(front, *args, *drafted)
    assert [t["reply"] for t in again] == [t["reply"] for t in reference]
    assert standin_hub.repo_gets[REPO] == 0, standin_hub.gets
    assert f"has the 10 files of {REPO} it needs (nothing to fetch)" in err, err
    fetched = [x for x in err.splitlines() if x.startswith("exokv: exokv-a: fetching 5 files")]
    assert [x.endswith(f" of {DRAFT_REPO}") for x in fetched] == [True], err
    assert _held(a, DRAFT_REPO) == META | {NON_LAYER_SHARD, *map(layer_shard, range(4))}
    assert not (b / ".cache/huggingface/hub/models--acme--llama-draft").exists()
    assert _held(tmp_path / "hf-front", DRAFT_REPO, "hub") == META
    # The draft model is the model itself here: every draft it makes is accepted.
    accepted = sum(t["accepted_tokens"] for t in again)
    assert accepted > 0 and accepted == sum(t["draft_tokens"] for t in again), again
    standin_hub.gets.clear()

    # --split auto (the default) on simulated uneven hosts places the layers 3,1: the
    # plan, read from the hub's headers and the hosts' memory, fetches nothing more.
    auto_env = {**front, "EXOKV_TEST_HOST_MEMORY": "24GB,8GB"}
    auto, err = _chat(auto_env, "--hostfile", str(hostfile), "--starting-port", "26575")
    plan = [e for e in auto[0]["events"] if e["kind"] == "plan"]
    assert plan and plan[0]["split"] == [3, 1] and plan[0]["source"] == "auto", err
    assert [t["reply"] for t in auto] == [t["reply"] for t in reference]
    assert sum(standin_hub.gets.values()) == 0, standin_hub.gets

    # Another split: only what is missing (exokv-b now runs layers 0-2).
    other, err = _chat(
        front, "--hostfile", str(hostfile), "--split", "1,3", "--starting-port", "26580"
    )
    assert [t["reply"] for t in other] == [t["reply"] for t in reference]
    assert standin_hub.downloaded() == {layer_shard(1), layer_shard(2)}, standin_hub.gets
    assert _held(b) == META | {NON_LAYER_SHARD, *(layer_shard(n) for n in range(3))}

    # `exokv models` per host: what each one holds, read on that host.
    listed = _run(front, "models", "--hostfile", str(hostfile), "--json")
    assert listed.returncode == 0, listed.stderr
    doc = json.loads(listed.stdout)
    assert [h["host"] for h in doc["hosts"]] == list(HOSTS)
    sizes = {}
    for host in doc["hosts"]:
        entry = {m["name"]: m for m in host["models"]}[REPO]
        assert entry["kind"] == "huggingface" and host["error"] is None
        held = {"exokv-a": 4, "exokv-b": 4}[host["host"]]  # a: 1-3 + shared, b: 0-2 + shared
        assert (entry["shards_held"], entry["shards_total"]) == (held, 5)
        sizes[host["host"]] = entry["size_bytes"]
    shard_bytes = {name: len(standin_hub.files[name]) for name in standin_hub.files}
    assert sizes["exokv-a"] == sum(shard_bytes[f] for f in _held(a))
    table = _run(front, "models", "--hosts", "exokv-a,exokv-b")
    assert table.returncode == 0 and table.stdout.count(REPO) == 2, table.stderr
    assert table.stdout.index("exokv-a") < table.stdout.index("exokv-b")


@pytest.mark.timeout(120)
def test_a_host_that_cannot_be_reached_is_one_line_naming_it(
    tmp_path: Path, ssh_hosts: SshHosts, standin_hub: StandinHub
) -> None:
    hostfile = _hostfile(tmp_path / "hosts.json", standin_hub.url, ["exokv-a", "exokv-nowhere"])
    front = _env(tmp_path, ssh_hosts, standin_hub.url, "hf")
    proc = _run(
        front,
        *("chat", "--model", REPO, "--json", "--hostfile", str(hostfile)),
        *("--starting-port", "26590"),
        stdin="hi\n",
    )
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    # Found by placement, before any host fetches: one line, the last, naming it.
    assert [x for x in lines if "exokv-nowhere" in x] == lines[-1:], proc.stderr
    assert "rank 1's host 'exokv-nowhere' cannot be reached: ssh: " in lines[-1]
    listed = _run(front, "models", "--hosts", "exokv-a,exokv-nowhere")
    assert listed.returncode == 1 and "exokv-a" in listed.stdout
    assert listed.stderr.strip().startswith("exokv: exokv-nowhere: could not list its models")
