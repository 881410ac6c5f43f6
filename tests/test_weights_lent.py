"""A host that cannot get the model itself is lent its layers' files by the others.

Three ssh hosts (tests/ssh_hosts.py `three_hosts`), each with its own home. The model
is a folder given as `~/models/llama-tiny`: A and B (and this machine) have it in their
homes, C has none. The chat starts on the three anyway: C gets the small files and the
shards of its layers from A, over ssh through the front end. A is then left out
(`/hosts drop`, the re-plan a host that is gone makes too): C runs more layers and gets
the one shard it lacks from B. Both replies are one rank's.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest
from chat_helpers import Chat
from hub_standin import NON_LAYER_SHARD, build_repo, layer_shard
from ssh_hosts import ThreeHosts
from test_host_gone import hostfile_of

pytestmark = pytest.mark.slow  # starts ranks over ssh: see tests/conftest.py

SCRIPT = ["Hello there, tell me about the sea", "And the ships?"]
MODEL = "~/models/llama-tiny"
SMALL = {
    "config.json",
    "generation_config.json",
    "model.safetensors.index.json",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
}
COPIED = re.compile(
    r"exokv: weights: (\d+) files \((.+?)\) copied from (\S+) to (\S+) in ([\d.]+) s"
)


@pytest.mark.timeout(300)
def test_a_host_without_the_model_is_lent_its_layers_files(
    tmp_path: Path, three_hosts: ThreeHosts
) -> None:
    model = build_repo(tmp_path / "llama-tiny")
    front_home = tmp_path / "front-home"
    for home in (front_home, three_hosts.homes["exokv-a"], three_hosts.homes["exokv-b"]):
        shutil.copytree(model, home / "models" / "llama-tiny")
    reference = Chat(tmp_path / "ref", "--model", str(model))
    expected = [reference.send(line) for line in SCRIPT]
    assert reference.finish()[0] == 0

    env = {"PATH": f"{three_hosts.bin_dir}:{os.environ['PATH']}", "HOME": str(front_home)}
    three = hostfile_of(tmp_path / "three.json", ["exokv-a", "exokv-b", "exokv-c"])
    chat = Chat(
        tmp_path / "front",
        *("--model", MODEL, "--hostfile", str(three), "--split", "2,1,1"),
        *("--starting-port", "32000"),
        env=env,
    )
    first = chat.send(SCRIPT[0])
    dropped = chat.send("/hosts drop exokv-a")
    assert dropped["ok"], dropped
    second = chat.send(SCRIPT[1])
    code, err = chat.finish(timeout=120)
    assert code == 0, err
    assert [first["ranks"], second["ranks"]] == [3, 2], err
    assert [first["reply"], second["reply"]] == [t["reply"] for t in expected], err

    # At the start C (rank 2: layer 0) gets the small files, the shard of the tensors
    # outside the layers and layer 0's, from A; on B and C after the re-plan it runs
    # layers 0-1 and gets layer 1's shard alone, from B.
    copies = [m.groups() for m in COPIED.finditer(err)]
    assert [(c[0], c[2], c[3]) for c in copies] == [
        (str(len(SMALL) + 2), "exokv-a", "exokv-c"),
        ("1", "exokv-b", "exokv-c"),
    ], err
    on_c = three_hosts.homes["exokv-c"] / "models" / "llama-tiny"
    held = {p.name for p in on_c.iterdir()}
    assert held == SMALL | {NON_LAYER_SHARD, layer_shard(0), layer_shard(1)}
    assert all((on_c / name).read_bytes() == (model / name).read_bytes() for name in held)
    for c in copies:
        print(f"copied {c[0]} files ({c[1]}) from {c[2]} to {c[3]} in {c[4]} s")
