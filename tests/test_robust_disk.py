"""A full disk under the KV disk tier, and a read-only home (real mounts, as root).

A 16 KB tmpfs mounted on EXOKV_HOME/kv has no room for the first entry; a read-only
bind mount of a healthy home is a home nobody can write. Each mount is undone in
teardown; where mounting is not allowed (not root, no tmpfs) the tests skip and say so.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from chat_helpers import exokv_text, home_with_models, run_exokv

pytestmark = pytest.mark.slow  # starts ranks, servers or real models: see tests/conftest.py


def _mount(args: list[str]) -> str:
    """'' when mounted, else why not."""
    try:
        proc = subprocess.run(["mount", *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError) as err:
        return str(err)
    return "" if proc.returncode == 0 else proc.stderr.strip() or f"exit {proc.returncode}"


def _umount(target: Path) -> None:
    subprocess.run(["umount", "-l", str(target)], capture_output=True, timeout=10)


@pytest.fixture
def full_caches(tmp_path: Path, models_dir: Path) -> Iterator[Path]:
    """A home whose disk tier folder is a 16 KB tmpfs: no KV cache entry fits."""
    home = home_with_models(tmp_path / "h", models_dir, link=True)
    caches = home / "kv"
    caches.mkdir()
    why = _mount(["-t", "tmpfs", "-o", "size=16k", "tmpfs", str(caches)])
    if why:
        pytest.skip(f"cannot mount a small tmpfs here: {why}")
    try:
        yield home
    finally:
        _umount(caches)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("ranks", "port"), [("1", "28200"), ("2", "28210")])
def test_a_full_disk_fails_the_save_not_the_chat(full_caches: Path, ranks: str, port: str) -> None:
    proc = run_exokv(
        ["chat", "-m", "builtin:tiny", "--json", "--max-tokens", "6", "-n", ranks]
        + ["--starting-port", port],
        full_caches,
        "Hello there\n/save\nWhy is the sky blue\n",
    )
    err = proc.stderr.decode()
    assert proc.returncode == 0, err
    docs = [json.loads(line) for line in proc.stdout.decode().splitlines()]
    assert [d.get("turn") for d in docs] == [1, None, 2]
    save = docs[1]
    assert save["command"] == "/save" and save["ok"] is False, save
    assert "not saved" in save["message"]
    # The save on quit fails too, and says so as one warning.
    warnings = [line for line in err.splitlines() if "not saved" in line]
    assert len(warnings) == 1 and warnings[0].startswith("exokv: warning:"), err
    assert "Traceback" not in err


@pytest.fixture
def read_only_home(tmp_path: Path, models_dir: Path) -> Iterator[Path]:
    """A healthy home (one chat's turn in it), seen through a read-only bind mount."""
    home = home_with_models(tmp_path / "h", models_dir, link=True)
    proc = run_exokv(["chat", "-m", "builtin:tiny", "--json", "--max-tokens", "4"], home, "hi\n")
    assert proc.returncode == 0, proc.stderr.decode()
    view = tmp_path / "ro"
    view.mkdir()
    why = _mount(["--bind", str(home), str(view)])
    if why:
        pytest.skip(f"cannot bind-mount here: {why}")
    try:
        why = _mount(["-o", "remount,ro,bind", str(view)])
        if why:
            pytest.skip(f"cannot make a read-only mount here: {why}")
        yield view
    finally:
        _umount(view)


@pytest.mark.timeout(120)
def test_a_read_only_home_is_read_only_not_corrupt(read_only_home: Path) -> None:
    for command in (["stats"], ["entries"], ["pressure"], ["evictions"]):
        proc = exokv_text(read_only_home, "cache", *command, "--json")
        assert proc.returncode == 0, (command, proc.stderr)
        json.loads(proc.stdout)
    stats = json.loads(exokv_text(read_only_home, "cache", "stats", "--json").stdout)
    assert stats["ranks"], stats  # the turn stored before the mount is there
    chat = exokv_text(read_only_home, "chat", "-m", "builtin:tiny", "--json", stdin="hi\n")
    lines = chat.stderr.strip().splitlines()
    assert chat.returncode == 1 and len(lines) == 1, chat.stderr
    assert "read-only" in lines[0] and "corrupt" not in lines[0] and "mv " not in lines[0]
