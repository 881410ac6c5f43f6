"""A chat killed outright (SIGKILL of the front end and every rank, no /save, no quit)
resumes warm: each turn wrote its entries through to the disk tier and appended a
journal record, so the next chat's turns hit nearly what an uninterrupted chat's do,
with the replies of --no-cache; a torn last record is dropped with one line."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import psutil
import pytest
from chat_helpers import Chat, home_with_models
from test_cluster import run_script
from test_disk_tier_chat import switch_script

from exokv.cache import journal
from exokv.cache.journal import JOURNAL_FILE, TREE_FILE

pytestmark = pytest.mark.slow  # starts ranks, servers or real models: see tests/conftest.py

MORE = [line for s in ("first", "s1", "s2", "s3") for line in (f"/switch {s}", "Go on?")]
TWO = ("-n", "2", "--disk-budget", "50MB")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, models_dir: Path):
    """The whole chat (the switch chat, then one more turn per session) in one run, on
    one rank, with the cache and with --no-cache."""
    base = tmp_path_factory.mktemp("uninterrupted")
    full = run_script(home_with_models(base / "full", models_dir, True), switch_script() + MORE)
    cold = home_with_models(base / "cold", models_dir, True)
    return full[8:], run_script(cold, switch_script() + MORE, "--no-cache")[8:]


def rank_dirs(home: Path) -> list[Path]:
    return sorted(p for p in (home / "kv").glob("*/*/rank*") if p.is_dir())


def kill_after_switch_chat(home: Path, *args: str) -> None:
    """The switch chat (8 turns in 4 sessions); once every rank's journal holds its
    8th record (written in the background after the reply), SIGKILL every process."""
    chat = Chat(home, *args)
    turns = [d for d in (chat.send(line) for line in switch_script()) if "turn" in d]
    assert len(turns) == 8
    deadline = time.monotonic() + 60
    while not (rank_dirs(home) and all(journal.last_seq(d) >= 8 for d in rank_dirs(home))):
        assert time.monotonic() < deadline, [journal.last_seq(d) for d in rank_dirs(home)]
        time.sleep(0.1)
    chat.note_descendants()
    procs = [psutil.Process(chat.proc.pid), *chat.seen.values()]
    # Frozen first, all of them: a rank that saw the front end go would quit cleanly
    # (spill, snapshot) before its own SIGKILL came; a crash gives it no such chance.
    for sig in (signal.SIGSTOP, signal.SIGKILL):
        for p in procs:
            try:
                p.send_signal(sig)
            except psutil.NoSuchProcess:
                pass
    chat.proc.wait(30)
    assert chat.proc.returncode == -signal.SIGKILL
    assert chat.leftovers() == []
    for d in rank_dirs(home):  # nothing but the journal holds the 8 turns
        assert json.loads((d / TREE_FILE).read_text())["seq"] == 0
        assert [r["seq"] for r in journal.read(d / JOURNAL_FILE, 0)[0]] == list(range(1, 9))


def resume(home: Path, *args: str) -> tuple[list[dict], str]:
    chat = Chat(home, *args)
    turns = [d for d in (chat.send(line) for line in MORE) if "turn" in d]
    code, err = chat.finish()
    assert code == 0, err
    return turns, err


@pytest.mark.timeout(300)
def test_sigkill_of_every_process_resumes_warm(uninterrupted, tmp_path, models_dir):
    full, cold = uninterrupted
    home = home_with_models(tmp_path / "h", models_dir, True)
    kill_after_switch_chat(home, *TWO, "--starting-port", "26710")
    assert len(rank_dirs(home)) == 2
    turns, err = resume(home, *TWO, "--starting-port", "26780")
    assert "torn" not in err and "starting cold" not in err, err
    assert [t["reply"] for t in turns] == [t["reply"] for t in cold]
    for t, ref in zip(turns, full, strict=True):
        assert t["cached_tokens"] >= 0.95 * ref["cached_tokens"], (t, ref)
        assert any(e["kind"] == "load" for e in t["events"])


@pytest.mark.timeout(300)
def test_a_record_torn_on_one_rank_is_dropped_on_both_with_one_line(
    uninterrupted, tmp_path, models_dir
):
    full, cold = uninterrupted
    home = home_with_models(tmp_path / "h", models_dir, True)
    kill_after_switch_chat(home, *TWO, "--starting-port", "26730")
    dirs = rank_dirs(home)
    assert len(dirs) == 2, dirs
    log = dirs[1] / JOURNAL_FILE
    records, _ = journal.read(log, 0)
    data = log.read_bytes()
    log.write_bytes(data[: len(data) - len(journal.encode(records[-1])) // 2])

    turns, err = resume(home, *TWO, "--starting-port", "26790")
    lines = [x for x in err.splitlines() if "torn" in x]
    assert lines == [
        "exokv: disk tier: rank 1's journal: its last record is torn (a crash while it was "
        "written): dropped; the cache is as of the turn before, and that turn's new tokens "
        "are prefilled again"
    ], err
    assert [t["reply"] for t in turns] == [t["reply"] for t in cold]
    # The torn record was the last turn's (session s3): the others are as warm as ever.
    for t, ref in zip(turns[:3], full[:3], strict=True):
        assert t["cached_tokens"] >= 0.95 * ref["cached_tokens"], (t, ref)
    assert 0 < turns[3]["cached_tokens"] < full[3]["cached_tokens"]
