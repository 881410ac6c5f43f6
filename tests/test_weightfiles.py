"""exokv.hosts.weightfiles: a model's files lent to a host that cannot get them itself.

The selection of files (which a host needs, which a source sends), the stream (whole
file or nothing, CRC-32 at both ends, a file cut short refused), the hub snapshot's
layout on the receiving host (blobs, links, refs) read back by the code that loads
it, and exokv.hosts.fetch's wiring: a host whose fetch failed, or that lacks a model
folder, is lent the files by the others. Each "host" is a folder of its own used as
HOME (and Hugging Face cache), its module run here as a short python subprocess, as
tests/test_kvfiles.py does. No mlx: the weights are safetensors files written by hand.
"""

from __future__ import annotations

import io
import json
import os
import struct
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

from exokv.errors import ExokvError
from exokv.hosts import fetch, weightfiles
from exokv.hosts.hostfile import Host, HostList
from exokv.hosts.kvfiles import CutShort, Received
from exokv.hosts.weightfiles import Holding, Place, plan_copies
from exokv.launch import remote
from exokv.launch.remote import RemoteRun
from exokv.model import hub
from exokv.model.resolve import model_id

REPO = "acme/tiny"
COMMIT = "c0ffee" + "0" * 28 + "123456"
LAYERS = 4
HOSTS = ("h1", "h2", "h3")


def safetensors(tensors: dict[str, int]) -> bytes:
    """A safetensors file of F32 tensors (name -> element count), zeros for data."""
    header: dict[str, object] = {}
    offset = 0
    for name, count in tensors.items():
        header[name] = {
            "dtype": "F32",
            "shape": [count],
            "data_offsets": [offset, offset + 4 * count],
        }
        offset += 4 * count
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + bytes(offset)


def shard(n: int) -> str:
    return f"model-{n:05d}-of-{LAYERS + 1:05d}.safetensors"


def model_files() -> dict[str, bytes]:
    """A 4-layer model: one shard for the embedding and head, one per layer, an index."""
    files = {shard(1): safetensors({"model.embed_tokens.weight": 64, "lm_head.weight": 64})}
    weight_map = {"model.embed_tokens.weight": shard(1), "lm_head.weight": shard(1)}
    for layer in range(LAYERS):
        name = f"model.layers.{layer}.mlp.weight"
        files[shard(layer + 2)] = safetensors({name: 32 + layer})
        weight_map[name] = shard(layer + 2)
    index = {"metadata": {"total_size": 1}, "weight_map": weight_map}
    files["model.safetensors.index.json"] = json.dumps(index).encode()
    files["config.json"] = json.dumps({"num_hidden_layers": LAYERS}).encode()
    files["tokenizer.json"] = b'{"model": {}}'
    return files


def write_folder(folder: Path, files: Mapping[str, bytes]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return folder


def write_snapshot(cache: Path, files: Mapping[str, bytes]) -> Path:
    """`files` as huggingface_hub caches them: blobs, a snapshot of links, refs/main."""
    storage = cache / f"models--{REPO.replace('/', '--')}"
    snapshot = storage / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (storage / "blobs").mkdir()
    for i, (name, data) in enumerate(files.items()):
        blob = f"{i:064x}" if name.endswith(".safetensors") else f"{i:040x}"
        (storage / "blobs" / blob).write_bytes(data)
        (snapshot / name).symlink_to(f"../../blobs/{blob}")
    (storage / "refs").mkdir()
    (storage / "refs" / "main").write_text(COMMIT)
    return snapshot


def want_args(ranks: int, host_ranks: str, split: str) -> list[str]:
    return ["--ranks", str(ranks), "--host-ranks", host_ranks, "--split", split]


# -- which files --------------------------------------------------------------------------


def test_a_host_needs_the_small_files_and_the_shards_of_its_layers(tmp_path: Path) -> None:
    place = Place(folder=str(write_folder(tmp_path / "m", model_files())))
    # Rank 1 of two, split 3,1: layer 0 (rank 0 runs the last layers), and the shard of
    # the tensors outside the layers, which every rank loads.
    want = hub.Want(ranks=2, host_ranks=[1], split=[3, 1])
    small = ["config.json", "model.safetensors.index.json", "tokenizer.json"]
    assert weightfiles.needed(place, want) == sorted([*small, shard(1), shard(2)])
    assert weightfiles.needed(Place(folder=str(tmp_path / "none")), want) is None
    files, blobs = weightfiles.held(place)
    assert files["config.json"] == len(model_files()["config.json"]) and blobs == {}


def test_copies_are_planned_file_by_file_from_the_first_holder() -> None:
    a = Holding({"config.json": 10, shard(1): 100, shard(2): 50})
    b = Holding({"config.json": 10, shard(3): 50})
    wanted = ["config.json", shard(1), shard(2), shard(3), shard(4)]
    # The target holds config.json alike (skipped) and shard 2 at another size (sent again).
    target = {"config.json": 10, shard(2): 7}
    copies, nowhere = plan_copies(wanted, target, [("a", a), ("b", b)])
    assert copies == {"a": [shard(1), shard(2)], "b": [shard(3)]}
    assert nowhere == [shard(4)]
    assert plan_copies(["config.json"], {"config.json": 10}, [("a", a)]) == ({}, [])


@pytest.mark.parametrize("name", ["", ".hidden", "a/b", "..", "x\\y", "a\0b"])
def test_a_path_is_never_a_file_name(name: str) -> None:
    assert not weightfiles.valid_name(name)


def test_a_model_folder_is_named_as_the_ranks_on_each_host_find_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert weightfiles.folder_place("~/models/m").folder == "~/models/m"  # each host's home
    assert weightfiles.folder_place("models/m").folder == str(tmp_path / "models" / "m")


def test_a_folder_holding_only_some_shards_names_the_model_as_the_whole_one(
    tmp_path: Path,
) -> None:
    files = model_files()
    whole = write_folder(tmp_path / "a" / "tiny", files)
    part = write_folder(tmp_path / "b" / "tiny", {n: d for n, d in files.items() if n != shard(3)})
    assert model_id(str(whole)) == model_id(str(part))


# -- the stream -----------------------------------------------------------------------------


def streamed(src: Place, names: Sequence[str]) -> bytes:
    out = io.BytesIO()
    weightfiles.send(src, names, out)
    return out.getvalue()


def test_the_files_arrive_byte_for_byte_and_one_missing_is_counted(tmp_path: Path) -> None:
    files = model_files()
    src = Place(folder=str(write_folder(tmp_path / "src", files)))
    dst = Place(folder=str(tmp_path / "dst" / "m"))
    counts = Received()
    names = ["config.json", shard(1), shard(3), "absent.json"]
    weightfiles.receive(dst, io.BytesIO(streamed(src, names)), counts)
    assert (counts.written, counts.missing, counts.bad) == (3, 1, 0)
    assert counts.bytes == sum(len(files[n]) for n in names[:3])
    for name in names[:3]:
        assert (tmp_path / "dst" / "m" / name).read_bytes() == files[name]
    assert sorted(p.name for p in (tmp_path / "dst" / "m").iterdir()) == sorted(names[:3])


def test_a_file_damaged_on_the_way_is_not_written(tmp_path: Path) -> None:
    files = model_files()
    src = Place(folder=str(write_folder(tmp_path / "src", files)))
    data = bytearray(streamed(src, [shard(2), "config.json"]))
    data[len(data) // 3] ^= 0xFF  # a byte of shard 2's data
    dst = tmp_path / "dst"
    counts = Received()
    weightfiles.receive(Place(folder=str(dst)), io.BytesIO(bytes(data)), counts)
    assert (counts.written, counts.bad) == (1, 1)
    assert sorted(p.name for p in dst.iterdir()) == ["config.json"]  # no temporary left


def test_a_stream_cut_short_leaves_no_file(tmp_path: Path) -> None:
    src = Place(folder=str(write_folder(tmp_path / "src", model_files())))
    data = streamed(src, [shard(1)])
    dst = tmp_path / "dst"
    with pytest.raises(CutShort):
        weightfiles.receive(Place(folder=str(dst)), io.BytesIO(data[:-100]), Received())
    assert not dst.exists() or not list(dst.iterdir())


def test_a_shard_cut_short_on_the_sending_host_is_not_sent(tmp_path: Path) -> None:
    files = dict(model_files())
    files[shard(2)] = files[shard(2)][:-4]  # its tensors end past the file
    src = Place(folder=str(write_folder(tmp_path / "src", files)))
    counts = Received()
    dst = Place(folder=str(tmp_path / "dst"))
    weightfiles.receive(dst, io.BytesIO(streamed(src, [shard(2), shard(3)])), counts)
    assert (counts.written, counts.missing) == (1, 1)
    assert not (tmp_path / "dst" / shard(2)).exists()


def test_a_hub_snapshot_arrives_as_a_snapshot_the_host_loads_offline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    files = model_files()
    src_cache, dst_cache = tmp_path / "src-cache", tmp_path / "dst-cache"
    write_snapshot(src_cache, files)
    place = Place(repo=REPO, commit=COMMIT, revision="main")
    want = hub.Want(ranks=2, host_ranks=[1], split=[3, 1])
    monkeypatch.setenv("HF_HUB_CACHE", str(src_cache))
    names = weightfiles.needed(place, want)
    assert names is not None and shard(2) in names and shard(3) not in names
    data = streamed(place, names)
    monkeypatch.setenv("HF_HUB_CACHE", str(dst_cache))
    counts = Received()
    weightfiles.receive(place, io.BytesIO(data), counts)
    assert counts.written == len(names) and counts.bad == 0
    storage = dst_cache / "models--acme--tiny"
    snapshot = storage / "snapshots" / COMMIT
    src_blobs = weightfiles.held(place)[1]  # read in the destination's cache now
    for name in names:
        link = snapshot / name
        # A link to the blob of the same name as on the sending host, as huggingface_hub has it.
        assert link.is_symlink() and os.readlink(link) == f"../../blobs/{src_blobs[name]}"
        assert link.read_bytes() == files[name]
    assert (storage / "refs" / "main").read_text() == COMMIT
    # What the ranks load (the revision's snapshot), and a fetch with no hub to ask.
    assert hub.cached_snapshot(REPO, None) == snapshot
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    got = hub.fetch(REPO, None, want, commit=COMMIT)
    assert got.path == snapshot and sorted(got.files) == sorted(names)


def test_the_host_side_refuses_what_is_no_model_place(capsys: pytest.CaptureFixture[str]) -> None:
    assert weightfiles.main(["have"]) == weightfiles.BAD_ARGUMENT
    assert weightfiles.main(["receive", "--repo", "../x", "--commit", COMMIT]) == 2
    assert weightfiles.main(["send", "--repo", REPO, "--commit", "main"]) == 2
    assert "not a hub repo and commit" in capsys.readouterr().err


# -- from the front end: lent by the hosts that have the files -------------------------------


@pytest.fixture
def hosts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Each host's home (h1, h2, h3) under one folder, its commands run here in that home
    and its own Hugging Face cache; this machine's home is `front`."""
    root = tmp_path / "hosts"
    for host in (*HOSTS, "front"):
        (root / host).mkdir(parents=True)
    real = remote.module_command

    def command(
        host: str | None,
        module: str,
        args: Sequence[str] = (),
        envs: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
    ) -> tuple[list[str], dict[str, str]]:
        argv, child_env = real(None, module, args, envs, env)
        home = root / (host or "front")
        cache = {"HF_HUB_CACHE": str(home / "hf")}
        return argv, {**child_env, "HOME": str(home), **cache}

    monkeypatch.setattr(remote, "module_command", command)
    return root


def three(split: list[int]) -> tuple[HostList, list[int]]:
    return HostList([Host(h) for h in HOSTS]), split


def test_a_host_without_the_model_folder_is_lent_its_files(
    hosts: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    files = model_files()
    for host in ("h1", "h2", "front"):
        write_folder(hosts / host / "models" / "tiny", files)
    monkeypatch.setenv("HOME", str(hosts / "front"))
    said: list[str] = []
    listed, split = three([2, 1, 1])
    fetch.fetch_onto_hosts("~/models/tiny", listed, split, "pipeline", say=said.append)
    # Rank 2 (h3) runs layer 0: the small files and the shards 1 and 2, from h1.
    got = hosts / "h3" / "models" / "tiny"
    small = ["config.json", "model.safetensors.index.json", "tokenizer.json"]
    assert sorted(p.name for p in got.iterdir()) == sorted([*small, shard(1), shard(2)])
    assert all((got / p.name).read_bytes() == files[p.name] for p in got.iterdir())
    assert len(said) == 1 and said[0].startswith("weights: 5 files (")
    assert said[0].endswith(" s") and " copied from h1 to h3 in " in said[0], said
    # Again: every host holds what it loads, nothing is copied or said.
    fetch.fetch_onto_hosts("~/models/tiny", listed, split, "pipeline", say=said.append)
    assert len(said) == 1
    # A re-plan on h2 and h3 (h1 gone): h3 now runs layers 0-1, the shard of layer 1 comes
    # from h2 (which holds the whole folder); only what h3 lacks.
    two = HostList([Host("h2"), Host("h3")])
    fetch.fetch_onto_hosts("~/models/tiny", two, [2, 2], "pipeline", say=said.append)
    assert said[-1].startswith("weights: 1 file (") and "from h2 to h3" in said[-1], said
    assert (got / shard(3)).read_bytes() == files[shard(3)]


def test_a_host_that_cannot_be_lent_the_files_says_which_and_why(
    hosts: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    files = model_files()
    partial = {n: d for n, d in files.items() if n != shard(2)}
    for host in ("h1", "front"):  # none holds shard 2, which h3 (layer 0) needs
        write_folder(hosts / host / "models" / "tiny", partial)
    write_folder(hosts / "h2" / "models" / "tiny", partial)
    monkeypatch.setenv("HOME", str(hosts / "front"))
    listed, split = three([2, 1, 1])
    with pytest.raises(ExokvError) as err:
        fetch.fetch_onto_hosts("~/models/tiny", listed, split, "pipeline", say=print)
    text = str(err.value)
    assert "\n" not in text and text.startswith("h3 lacks 1 file of ~/models/tiny"), text
    assert shard(2) in text and "no model folder there" in text and "no host" in text


def test_a_host_whose_fetch_failed_is_lent_the_snapshot_by_a_host_that_fetched(
    hosts: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    files = model_files()
    for host in ("h1", "h2"):
        write_snapshot(hosts / host / "hf", files)
    monkeypatch.setattr(fetch, "_commit_here", lambda name, model: COMMIT)

    def fetched(hosts_: Sequence[str], module: str, args_for, **kw) -> list[RemoteRun]:
        ok = json.dumps({"event": "done"})
        failed = json.dumps({"event": "error", "message": "cannot reach the hub at http://x"})
        return [
            RemoteRun(h, 1, failed + "\n", "") if h == "h3" else RemoteRun(h, 0, ok + "\n", "")
            for h in hosts_
        ]

    monkeypatch.setattr(fetch, "run_on_each", fetched)
    said: list[str] = []
    listed, split = three([2, 1, 1])
    fetch.fetch_onto_hosts(REPO, listed, split, "pipeline", say=said.append)
    assert (
        [x for x in said if x.startswith("weights:")]
        == [x for x in said if " copied from h1 to h3 in " in x]
        != []
    )
    snapshot = hosts / "h3" / "hf" / "models--acme--tiny" / "snapshots" / COMMIT
    assert (snapshot / shard(2)).is_symlink() and (snapshot / shard(2)).read_bytes() == files[
        shard(2)
    ]
    assert (snapshot.parent.parent / "refs" / "main").read_text() == COMMIT

    # A host ssh cannot reach is not lent anything: the fetch's failure, as before.
    def unreachable(hosts_: Sequence[str], module: str, args_for, **kw) -> list[RemoteRun]:
        return [RemoteRun(h, 255, "", "", "ssh: connect refused") for h in hosts_]

    monkeypatch.setattr(fetch, "run_on_each", unreachable)
    with pytest.raises(ExokvError, match="fetching acme/tiny onto h1: ssh: connect refused"):
        fetch.fetch_onto_hosts(REPO, listed, split, "pipeline", say=said.append)


def test_a_snapshot_with_a_file_damaged_on_the_way_is_not_named_by_the_revision(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_snapshot(tmp_path / "src-cache", model_files())
    place = Place(repo=REPO, commit=COMMIT, revision="main")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "src-cache"))
    data = bytearray(streamed(place, ["config.json", shard(1)]))
    data[-10] ^= 0xFF  # a byte of the shard's data
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "dst-cache"))
    counts = Received()
    weightfiles.receive(place, io.BytesIO(bytes(data)), counts)
    assert (counts.written, counts.bad) == (1, 1)
    assert not (tmp_path / "dst-cache" / "models--acme--tiny" / "refs" / "main").exists()
    assert hub.cached_snapshot(REPO, None) is None
