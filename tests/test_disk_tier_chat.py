"""The disk tier through `exokv chat` (builtin:tiny): a switch chat under a RAM budget
holding a third of it, on 1 and 2 uneven ranks; a restart warm from disk; a full disk."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from chat_helpers import cache_json, chat_json, exokv_text, home_with_models, run_exokv
from test_cluster import rank_log, run_script

pytestmark = pytest.mark.slow  # starts ranks, servers or real models: see tests/conftest.py

QUESTIONS = ["Tell me about cats", "Tell me about the sea", "Tell me about winter", "Rivers?"]
FOLLOW = ["And dogs?", "Why blue?", "Is it cold?", "How long?"]


def switch_script() -> list[str]:
    """Four conversations, two turns each, interleaved turn by turn."""
    lines = [QUESTIONS[0]]
    for i, q in enumerate(QUESTIONS[1:], 1):
        lines += [f"/new s{i}", q]
    lines += [
        line
        for i, follow in enumerate(FOLLOW)
        for line in (f"/switch {'s' + str(i) if i else 'first'}", follow)
    ]
    return ["/new first", *lines]


def peak(turns: list[dict]) -> int:
    return max(t["rank_stats"][0]["cache_bytes"] for t in turns)


@pytest.fixture(scope="module")
def references(tmp_path_factory, models_dir: Path):
    """The unbudgeted run and the --no-cache run of the switch chat, on one rank."""
    home = home_with_models(tmp_path_factory.mktemp("ref"), models_dir, link=True)
    full = chat_json(switch_script(), home)
    cold = chat_json(
        switch_script(), home_with_models(home.parent / "cold", models_dir, True), "--no-cache"
    )
    return full, cold


@pytest.mark.timeout(120)
def test_one_rank_a_third_of_the_switch_chat_in_ram(references, tmp_path, models_dir):
    full, cold = references
    budget = peak(full) // 3
    home = home_with_models(tmp_path / "h", models_dir, link=True)
    turns = chat_json(switch_script(), home, "--cache-budget", str(budget), "--disk-budget", "50MB")
    assert [t["cached_tokens"] for t in turns] == [t["cached_tokens"] for t in full]
    assert [t["reply"] for t in turns] == [t["reply"] for t in cold]
    assert all(t["rank_stats"][0]["cache_bytes"] <= budget for t in turns)
    kinds = [e["kind"] for t in turns for e in t["events"]]
    assert "spill" in kinds and "load" in kinds and "evict" not in kinds
    # Inspection: each entry's tier, and bytes per tier per rank.
    rows = cache_json(home, "entries")["entries"]
    assert {r["tier"] for r in rows} == {"ram", "disk"}
    stats = cache_json(home, "stats")["ranks"][0]
    assert 0 < stats["bytes"] <= budget and stats["disk_bytes"] > 0
    ram = sum(r["bytes"][0] for r in rows if r["tier"] == "ram")
    assert stats["bytes"] == ram == turns[-1]["rank_stats"][0]["cache_bytes"]
    # Written through: every RAM entry has a copy on disk too, which the tier's bytes
    # on disk count (the budget has room for all of it), and so does `cache stats`.
    spilled = sum(r["bytes"][0] for r in rows if r["tier"] == "disk")
    assert spilled + ram == turns[-1]["rank_stats"][0]["disk_bytes"] == stats["disk_bytes"]


@pytest.mark.timeout(240)
def test_two_uneven_ranks_spill_and_load_alike(references, tmp_path, models_dir):
    full, cold = references
    whole = peak(full)
    budgets = (whole * 3 // 4 // 3, whole // 4 // 4)  # split 3,1: a third and a quarter
    home = home_with_models(tmp_path / "two", models_dir)
    args = (
        *("-n", "2", "--split", "3,1", "--max-tokens", "12"),
        *("--cache-budget", ",".join(map(str, budgets)), "--disk-budget", "50MB"),
        *("--starting-port", "29010"),
    )
    turns = run_script(home, switch_script(), *args, env={"EXOKV_RANK_LOG": "1"})
    assert [t["cached_tokens"] for t in turns] == [t["cached_tokens"] for t in full]
    assert [t["reply"] for t in turns] == [t["reply"] for t in cold]
    logs = [rank_log(home, 0), rank_log(home, 1)]
    for t0, t1 in zip(*logs, strict=True):
        own = [t0["rank_stats"][0]["cache_bytes"], t1["rank_stats"][1]["cache_bytes"]]
        assert all(b <= cap for b, cap in zip(own, budgets, strict=True)), own
        assert t0["events"] == t1["events"]  # spills, loads and drops alike on both
        assert t0["rank_stats"][1]["disk_bytes"] == t1["rank_stats"][1]["disk_bytes"]
    kinds = [e["kind"] for t in logs[0] for e in t["events"]]
    assert kinds.count("spill") > 2 and kinds.count("load") > 2
    # The ranks share this machine's pool; each file names its rank's layers (split 3,1:
    # rank 0 runs layers 1-3, rank 1 layer 0).
    pool = list((home / "kv").rglob("pool-*/*.kv"))
    files = [[f for f in pool if f".L{layers}." in f.name] for layers in ("1-4", "0-1")]
    assert files[0] and files[1] and len(files[0]) + len(files[1]) == len(pool)

    # Restarted, with every file of rank 1 corrupted: both ranks take it as a miss.
    reference = home_with_models(tmp_path / "ref", models_dir, link=True)
    for db in home.glob("exokv.db*"):
        shutil.copy(db, reference / db.name)
    more = ["/switch s2", "One more?"]
    cold_reply = chat_json(more, reference, "--no-cache")[0]["reply"]
    for f in files[1]:
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0xFF
        f.write_bytes(bytes(data))
    args = (*args[:-2], "--starting-port", "29020")
    (turn,) = run_script(home, more, *args)
    assert turn["reply"] == cold_reply
    assert turn["cached_tokens"] == 0
    drops = [e for e in turn["events"] if e["kind"] == "drop"]
    assert drops and all(e["reason"].startswith("unreadable on rank 1") for e in drops)


@pytest.mark.timeout(180)
def test_restart_first_turns_are_served_from_disk(references, tmp_path, models_dir):
    full, _ = references
    home = home_with_models(tmp_path / "r", models_dir, link=True)
    lines = switch_script()
    first_half = lines[: lines.index("/switch first")]
    chat_json(first_half, home, "--disk-budget", "50MB")
    assert list((home / "kv").rglob("tree.json"))
    again = chat_json(lines[len(first_half) :], home, "--disk-budget", "50MB")
    # Each earlier session's first turn after the restart hits what it had reached.
    assert [t["cached_tokens"] for t in again] == [t["cached_tokens"] for t in full[4:]]
    assert [t["reply"] for t in again] == [t["reply"] for t in full[4:]]
    assert all(any(e["kind"] == "load" for e in t["events"]) for t in again)
    # `exokv cache clear` forgets the disk tier too.
    assert exokv_text(home, "cache", "clear", "--yes").returncode == 0
    assert not (home / "kv").exists()


@pytest.mark.timeout(180)
def test_a_full_disk_stops_spilling_with_one_warning(references, tmp_path, models_dir):
    full, cold = references
    home = home_with_models(tmp_path / "home", models_dir, link=True)
    (home / "kv").mkdir()
    done = subprocess.run(
        # Room for the first turns written through, not for the whole chat.
        ["mount", "-t", "tmpfs", "-o", "size=120k", "tmpfs", str(home / "kv")],
        capture_output=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs: {done.stderr.decode().strip()}")
    try:
        proc = run_exokv(
            ["chat", "-m", "builtin:tiny", "--json", "--max-tokens", "12"]
            + ["--cache-budget", str(peak(full) // 3), "--disk-budget", "50MB"],
            home,
            "\n".join(switch_script()) + "\n",
        )
    finally:
        subprocess.run(["umount", str(home / "kv")], capture_output=True)
    assert proc.returncode == 0, proc.stderr.decode()
    docs = [json.loads(x) for x in proc.stdout.decode().splitlines() if x.strip()]
    turns = [d for d in docs if "turn" in d]
    warnings = [x for x in proc.stderr.decode().splitlines() if "spilling stopped" in x]
    assert len(warnings) == 1, proc.stderr.decode()
    assert [t["reply"] for t in turns] == [t["reply"] for t in cold]  # on from RAM
    events = [e for t in turns for e in t["events"]]
    stop = next(i for i, e in enumerate(events) if "spilling stopped" in e["reason"])
    assert not [e for e in events[stop:] if e["kind"] == "spill"]
    # Nothing written before is lost: every load that failed is a write that failed.
    assert any(e["kind"] == "load" for e in events)
    unreadable = [e for e in events if e["kind"] == "drop" and "unreadable" in e["reason"]]
    assert all("its write failed" in e["reason"] for e in unreadable), unreadable


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--disk-budget", "lots"], "--disk-budget 'lots': use a size (20GB, 512MB), auto or 0"),
        (["--kv-bits", "3"], "--kv-bits 3: use 4 or 8"),
        (["--kv-bits", "8", "--kv-group-size", "48"], "--kv-group-size 48: use 32, 64 or 128"),
    ],
)
def test_bad_tier_options_are_one_line_usage_errors(tmp_path, args, words):
    proc = run_exokv(["chat", "-m", "builtin:tiny", "--json", *args], tmp_path, "Hi\n")
    assert proc.returncode == 2, proc.stderr.decode()
    err = proc.stderr.decode()
    assert words in err and "Traceback" not in err
