"""A host that cannot get the model itself is lent its layers' files by the others.

Two ssh hosts (tests/ssh_hosts.py `ssh_hosts`), each with its own home. The model is a
folder given as `~/models/llama-tiny`: A (and this machine) have it in their homes, B
has none. The chat starts on the two anyway: B gets the small files and the shards of
its layers from A, over ssh through the front end, and the replies are one rank's.
(A re-plan, a host gone or `/hosts add`, lends the same way, through the same
exokv.hosts.fetch call: tests/test_weightfiles.py has one on the hosts left.)
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
from chat_helpers import Chat
from hub_standin import NON_LAYER_SHARD, build_repo, layer_shard
from ssh_hosts import HOSTS, SshHosts

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
    r"exokv: weights: (\d+) files? \((.+?)\) copied from (\S+) to (\S+) in ([\d.]+) s"
)


@pytest.mark.timeout(300)
def test_a_host_without_the_model_is_lent_its_layers_files(
    tmp_path: Path, ssh_hosts: SshHosts
) -> None:
    model = build_repo(tmp_path / "llama-tiny")
    front_home = tmp_path / "front-home"
    for home in (front_home, ssh_hosts.homes["exokv-a"]):
        shutil.copytree(model, home / "models" / "llama-tiny")
    reference = Chat(tmp_path / "ref", "--model", str(model))
    expected = [reference.send(line) for line in SCRIPT]
    assert reference.finish()[0] == 0

    env = {"PATH": f"{ssh_hosts.bin_dir}:{os.environ['PATH']}", "HOME": str(front_home)}
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([{"ssh": name, "ips": [ip]} for name, ip in HOSTS.items()]))
    chat = Chat(
        tmp_path / "front",
        *("--model", MODEL, "--hostfile", str(hostfile), "--split", "3,1"),
        *("--starting-port", "32000"),
        env=env,
    )
    turns = [chat.send(line) for line in SCRIPT]
    code, err = chat.finish(timeout=120)
    assert code == 0, err
    assert [t["ranks"] for t in turns] == [2, 2], err
    assert [t["reply"] for t in turns] == [t["reply"] for t in expected], err

    # B (rank 1: layer 0) gets the small files, the shard of the tensors outside the
    # layers and layer 0's, from A, and nothing else.
    copies = [m.groups() for m in COPIED.finditer(err)]
    assert [(c[0], c[2], c[3]) for c in copies] == [(str(len(SMALL) + 2), "exokv-a", "exokv-b")]
    on_b = ssh_hosts.homes["exokv-b"] / "models" / "llama-tiny"
    held = {p.name for p in on_b.iterdir()}
    assert held == SMALL | {NON_LAYER_SHARD, layer_shard(0)}
    assert all((on_b / name).read_bytes() == (model / name).read_bytes() for name in held)
    print(f"copied {copies[0][0]} files ({copies[0][1]}) in {copies[0][4]} s")
