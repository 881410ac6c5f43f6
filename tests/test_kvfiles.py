"""exokv.hosts.kvfiles: KV files listed, sent and received on a host, and copied between two.

Each "host" is a folder of its own used as EXOKV_HOME, and its module runs here as a
short python subprocess. `copy_files` is tried two ways (the `route` fixture): with the
command of each host made local with that host's home (fast), and through a stand-in
`ssh` first on PATH that runs the remote command here with the host's home (the real
command lines, ssh options and all; marked slow, as conftest.py's guard has every test
that runs `ssh ... exokv` be). No mlx: the files are made with the header alone.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import pytest

from exokv.errors import ExokvError
from exokv.hosts import kvfiles
from exokv.hosts.kvfiles import Copied, copy_files, list_files
from exokv.launch import remote

REL = "model/config/pool-7"
HOSTS = ("h1", "h2")
FAKE_SSH = """#!/bin/sh
# A stand-in for ssh: the options dropped, the command run here with HOST's own home.
while [ "$1" = "-o" ]; do shift 2; done
host=$1; shift
if [ ! -d "{root}/$host" ]; then
    echo "ssh: Could not resolve hostname $host: Name or service not known" >&2
    exit 255
fi
EXOKV_HOME="{root}/$host" exec sh -c "$*"
"""


def kv_file(body: bytes) -> bytes:
    """A KV file as exokv.cache.disk writes one: magic, CRC-32 and length, then the body."""
    return struct.pack("<4sIQ", b"EXKV", zlib.crc32(body), len(body)) + body


def pool(root: Path, host: str) -> Path:
    return root / host / "kv" / REL


def put(root: Path, host: str, name: str, data: bytes) -> Path:
    path = pool(root, host) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def module(
    home: Path, *args: str, stdin: bytes | None = None
) -> subprocess.CompletedProcess[bytes]:
    """The host side run here with `home` as EXOKV_HOME."""
    env = {**os.environ, "EXOKV_HOME": str(home)}
    env.pop("EXOKV_DEBUG", None)
    return subprocess.run(
        [sys.executable, "-m", "exokv.hosts.kvfiles", *args],
        input=stdin,
        capture_output=True,
        env=env,
        timeout=60,
    )


@pytest.fixture(params=["local", pytest.param("ssh", marks=pytest.mark.slow)])
def route(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Path]:
    """The folder holding each host's home (h1, h2), reached one way or the other; any
    other host name is unreachable."""
    root = tmp_path / "hosts"
    for host in HOSTS:
        (root / host).mkdir(parents=True)
    if request.param == "ssh":
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir()
        (bin_dir / "ssh").write_text(FAKE_SSH.format(root=root))
        (bin_dir / "ssh").chmod(0o755)
        monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    else:
        monkeypatch.setattr(remote, "module_command", local_command(root))
    yield root


def local_command(root: Path):
    """remote.module_command with each host's command run here, in that host's home."""
    real = remote.module_command

    def command(
        host: str | None,
        module: str,
        args: Sequence[str] = (),
        envs: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
    ) -> tuple[list[str], dict[str, str]]:
        argv, child_env = real(None, module, args, envs, env)
        if host not in HOSTS:
            return [str(root / "no-such-program")], child_env  # cannot start
        return argv, {**child_env, "EXOKV_HOME": str(root / host)}

    return command


# -- copies ----------------------------------------------------------------------------


def test_a_copy_arrives_byte_for_byte(route: Path) -> None:
    files = {f"{i}.L0-4.kv": kv_file(os.urandom(1000 * (i + 1))) for i in range(3)}
    for name, data in files.items():
        put(route, "h1", name, data)
    copied = copy_files("h1", "h2", REL, list(files), wait=1)
    assert copied.error == "" and copied.files == 3, copied
    assert copied.bytes == sum(len(d) for d in files.values()) and copied.seconds > 0
    for name, data in files.items():
        assert (pool(route, "h2") / name).read_bytes() == data
    assert list_files("h2", REL) == {n: len(d) for n, d in files.items()}
    assert not list(pool(route, "h2").glob("*.tmp"))


def test_a_file_already_there_the_same_is_not_written_again(route: Path) -> None:
    same, other = kv_file(b"same" * 50), kv_file(b"new" * 50)
    put(route, "h1", "1.L0-4.kv", same)
    put(route, "h1", "2.L0-4.kv", other)
    kept = put(route, "h2", "1.L0-4.kv", same)
    stale = put(route, "h2", "2.L0-4.kv", kv_file(b"old" * 50))
    os.utime(kept, (1_000_000, 1_000_000))
    copied = copy_files("h1", "h2", REL, ["1.L0-4.kv", "2.L0-4.kv"], wait=1)
    assert (copied.error, copied.files, copied.skipped) == ("", 1, 1), copied
    assert kept.stat().st_mtime == 1_000_000
    assert stale.read_bytes() == other  # a different file of that name is replaced


def test_a_file_damaged_at_the_source_is_not_copied(route: Path) -> None:
    damaged = bytearray(kv_file(b"x" * 300))
    damaged[100] ^= 0xFF  # a body byte: the CRC no longer matches
    put(route, "h1", "1.L0-4.kv", bytes(damaged))
    put(route, "h1", "2.L0-4.kv", kv_file(b"fine"))
    copied = copy_files("h1", "h2", REL, ["1.L0-4.kv", "2.L0-4.kv"], wait=0.2)
    assert (copied.error, copied.files, copied.missing) == ("", 1, 1), copied
    assert list_files("h2", REL) == {"2.L0-4.kv": len(kv_file(b"fine"))}


def test_names_that_never_appear_share_one_wait(route: Path) -> None:
    names = ["5.L0-4.kv", "6.L0-4.kv", "7.L0-4.kv", "not-a-kv-file", "../1.L0-4.kv"]
    started = time.monotonic()
    copied = copy_files("h1", "h2", REL, names, wait=0.5)
    assert time.monotonic() - started < 10  # one deadline: not 0.5 s for each
    assert (copied.error, copied.files, copied.missing) == ("", 0, 5), copied
    assert list_files("h2", REL) == {}


def test_a_file_the_rank_writes_during_the_wait_is_sent(route: Path) -> None:
    data = kv_file(b"late" * 100)

    def write_late() -> None:
        time.sleep(0.5)
        tmp = put(route, "h1", "9.L4-8.kv.tmp", data)
        tmp.rename(tmp.with_name("9.L4-8.kv"))  # as the disk tier does: whole, by a rename

    writer = threading.Thread(target=write_late)
    writer.start()
    copied = copy_files("h1", "h2", REL, ["9.L4-8.kv"], wait=20)
    writer.join()
    assert (copied.error, copied.files) == ("", 1), copied
    assert (pool(route, "h2") / "9.L4-8.kv").read_bytes() == data


def test_a_copy_past_its_time_limit_is_ended(route: Path) -> None:
    started = time.monotonic()
    copied = copy_files("h1", "h2", REL, ["1.L0-4.kv"], wait=60, timeout=1)
    assert time.monotonic() - started < 20
    assert "took over 1 s" in copied.error and copied.files == 0, copied


@pytest.mark.parametrize("src, dst", [("h1", "nowhere"), ("nowhere", "h2")])
def test_a_host_out_of_reach_is_an_error_returned(route: Path, src: str, dst: str) -> None:
    put(route, "h1", "1.L0-4.kv", kv_file(b"x"))
    copied = copy_files(src, dst, REL, ["1.L0-4.kv"], wait=0.2)
    assert copied.error and "\n" not in copied.error and copied.files == 0, copied
    with pytest.raises(ExokvError, match="on nowhere"):
        list_files("nowhere", REL)


def test_nothing_to_copy_starts_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("started a process")

    monkeypatch.setattr(subprocess, "Popen", refuse)
    assert copy_files("h1", "h2", REL, []) == Copied(0, 0, 0.0)
    assert copy_files("h1", "h1", REL, ["1.L0-4.kv"]) == Copied(0, 0, 0.0)
    assert copy_files(None, None, REL, ["1.L0-4.kv"]) == Copied(0, 0, 0.0)


# -- the host side alone ------------------------------------------------------------------


def stream(*frames: tuple[bytes, bytes | None], end: bool = True) -> bytes:
    out = b""
    for name, data in frames:
        length = -1 if data is None else len(data)
        out += struct.pack("<H", len(name)) + name + struct.pack("<q", length) + (data or b"")
    return out + (struct.pack("<H", 0) if end else b"")


def test_damage_on_the_way_and_bad_names_are_counted_not_written(tmp_path: Path) -> None:
    good = kv_file(b"good")
    damaged = bytearray(kv_file(b"damaged" * 20))
    damaged[-1] ^= 1
    frames = stream(
        (b"1.L0-4.kv", good),
        (b"2.L0-4.kv", bytes(damaged)),
        (b"../3.L0-4.kv", good),
        (b"\xff.kv", good),
        (b"4.L0-4.kv", None),
    )
    run = module(tmp_path, "receive", REL, stdin=frames)
    assert run.returncode == 0, run.stderr
    said = json.loads(run.stdout)
    assert said == {"written": 1, "bytes": len(good), "skipped": 0, "bad": 3, "missing": 1}
    assert sorted(p.name for p in (tmp_path / "kv" / REL).iterdir()) == ["1.L0-4.kv"]
    assert not (tmp_path / "kv" / "model" / "config" / "3.L0-4.kv").exists()


def test_a_stream_cut_short_keeps_what_came_and_says_so(tmp_path: Path) -> None:
    good = kv_file(b"good")
    cut = stream((b"1.L0-4.kv", good), end=False) + struct.pack("<H", 9) + b"2.L0"
    run = module(tmp_path, "receive", REL, stdin=cut)
    assert run.returncode == kvfiles.CUT_SHORT
    assert json.loads(run.stdout)["written"] == 1
    assert len(run.stderr.decode().splitlines()) == 1 and b"Traceback" not in run.stderr


def test_send_writes_one_frame_a_name_then_the_end(tmp_path: Path) -> None:
    data = kv_file(b"abc")
    (tmp_path / "kv" / REL).mkdir(parents=True)
    (tmp_path / "kv" / REL / "1.L0-4.kv").write_bytes(data)
    run = module(tmp_path, "send", REL, "--wait", "0", "1.L0-4.kv", "2.L0-4.kv")
    assert run.returncode == 0, run.stderr
    assert run.stdout == stream((b"1.L0-4.kv", data), (b"2.L0-4.kv", None))


@pytest.mark.parametrize("command", [["list"], ["send", "--wait", "0"], ["receive"]])
@pytest.mark.parametrize("rel", ["../x/pool-1", "/abs/pool-1", "kv/x", "a/../pool-1", ""])
def test_a_path_outside_a_pool_is_refused(tmp_path: Path, command: list[str], rel: str) -> None:
    run = module(tmp_path, command[0], rel, *command[1:], stdin=b"")
    assert run.returncode == 2
    assert len(run.stderr.decode().splitlines()) == 1 and b"Traceback" not in run.stderr


def test_a_pool_not_made_yet_lists_empty(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = module(tmp_path, "list", REL)
    assert run.returncode == 0 and json.loads(run.stdout) == {"files": {}}
    (tmp_path / "kv" / REL).mkdir(parents=True)
    for name in ("1.L0-4.kv", "01.L0-4.kv", "1.kv", "1.L0-4.kv.tmp", "lock"):
        (tmp_path / "kv" / REL / name).write_bytes(b"12345")
    monkeypatch.setenv("EXOKV_HOME", str(tmp_path))
    assert list_files(None, REL) == {"1.L0-4.kv": 5}


def test_a_pool_that_cannot_be_made_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "kv").mkdir()
    (tmp_path / "kv" / "model").write_text("a file where a folder goes")
    run = module(tmp_path, "receive", REL, stdin=stream((b"1.L0-4.kv", kv_file(b"x"))))
    assert run.returncode == 1
    assert len(run.stderr.decode().splitlines()) == 1 and b"Traceback" not in run.stderr


def test_the_host_side_starts_without_mlx() -> None:
    code = "import sys, exokv.hosts.kvfiles; print(sorted(m for m in sys.modules if 'mlx' in m))"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stdout.strip() == "[]", run


def test_the_header_is_the_disk_tiers() -> None:
    from exokv.cache import disk  # mlx, which this test process has already

    assert kvfiles.MAGIC == disk.MAGIC and kvfiles.HEADER.format == disk._HEADER.format
    body = disk.encode({"a": None})
    assert kvfiles.intact(body) and not kvfiles.intact(body[:-1])
