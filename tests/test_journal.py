"""The disk tier's journal in one process: every turn written through and recorded,
so a chat that ends without quitting (a crash: no spill, no snapshot) restarts warm;
a torn last record is dropped with one line; a record holds what its turn changed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from exokv.cache import journal
from exokv.cache.journal import JOURNAL_FILE, TREE_FILE
from exokv.rank.engine import Engine
from tests.test_cache_budget import chats, play, tokenizer  # noqa: F401
from tests.test_disk_tier import (
    _second_half,
    has_file,
    restarts_warm,
    tiered,
    working_set,
)


def crash(engine: Engine) -> None:
    """End like a killed process: the writer's queue drains (as it would in the
    moments before the kill), then nothing more — no spill, no snapshot, no close."""
    tier = engine.coord.tier
    tier.store.flush()
    tier.store.release()


def first_half_then_crash(kind: str, tok, home: Path):
    reference, _ = working_set(kind, tok)
    script = chats(4, 2)
    engine = tiered(kind, tok, home, None)
    first = play(engine, script[:4])
    crash(engine)
    replies = {r.session: [r.reply] for r in first}
    pairs = [(r.reply, engine.reply_tokens(r.reply)) for r in first]
    return reference, script, replies, pairs, first


@pytest.mark.parametrize("kind", ["window", "state"])
def test_a_crash_after_a_turn_restarts_warm_from_snapshot_and_journal(kind, tokenizer, tmp_path):  # noqa: F811
    reference, script, replies, pairs, _ = first_half_then_crash(kind, tokenizer, tmp_path)
    snapshot = json.loads((tmp_path / "rank0" / TREE_FILE).read_text())
    assert snapshot["nodes"] == [] and snapshot["seq"] == 0  # the start's: nothing yet
    records, why = journal.read(tmp_path / "rank0" / JOURNAL_FILE, 0)
    assert why == "" and [r["seq"] for r in records] == [1, 2, 3, 4]  # one per turn
    restarts_warm(kind, tokenizer, tmp_path, reference, script, replies, pairs)


def test_a_torn_last_record_is_dropped_with_one_line(tokenizer, tmp_path):  # noqa: F811
    reference, script, replies, pairs, first = first_half_then_crash("state", tokenizer, tmp_path)
    log = tmp_path / "rank0" / JOURNAL_FILE
    records, _ = journal.read(log, 0)
    last_new = {rec["id"] for rec in records[-1]["nodes"]} - {
        rec["id"] for r in records[:-1] for rec in r["nodes"]
    }
    assert last_new and all(has_file(tmp_path, i) for i in last_new)
    data = log.read_bytes()
    cut = len(data) - len(journal.encode(records[-1])) // 2
    log.write_bytes(data[:cut])  # the last record torn in half
    (pool,) = tmp_path.glob("pool-*")
    (pool / "99.L0-1.tmp").write_bytes(b"half a file")  # a write the crash cut short

    again = tiered("state", tokenizer, tmp_path, None)
    assert "its last record is torn" in again.tier_notice
    assert "dropped" in again.tier_notice and "\n" not in again.tier_notice
    # The files only the dropped record covered are removed; the journal starts afresh.
    assert not any(has_file(tmp_path, i) for i in last_new)
    assert not list(tmp_path.glob("pool-*/*.tmp"))
    assert journal.read(log, 0) == ([], "")
    again.remember_replies(pairs)
    results = _second_half(again, script, replies)
    assert [r.reply for r in results] == [r.reply for r in reference[4:]]
    # The last turn's session (s3) lost that turn's entries, and no other.
    assert [r.cached_tokens for r in results[:3]] == [r.cached_tokens for r in reference[4:7]]
    assert 0 < results[3].cached_tokens < reference[7].cached_tokens
    assert results[3].cached_tokens == first[3].cached_tokens  # what the turn before held


def test_a_record_holds_what_its_turn_changed_not_the_tree(tokenizer, tmp_path):  # noqa: F811
    """On a tree of many entries, a turn's record names the nodes the turn touched."""
    engine = tiered("window", tokenizer, tmp_path, None)
    script = chats(8, 2)
    play(engine, script)
    engine.coord.tier.store.flush()
    size = len(engine.cache.tree)
    records, _ = journal.read(tmp_path / "rank0" / JOURNAL_FILE, 0)
    last = records[-1]
    named = len(last["nodes"]) + len(last["used"]) + len(last["gone"])
    path = engine.cache.tree.match(engine.render(script[-1][1])).path
    assert named <= len(path) + 3 and 2 * (len(path) + 3) < size, (named, len(path), size)


def test_compacting_keeps_the_tree(tokenizer, tmp_path, monkeypatch):  # noqa: F811
    """With the journal compacted at every turn, a crash still restarts warm."""
    monkeypatch.setattr(journal, "MIN_COMPACT", 0)
    reference, script, replies, pairs, _ = first_half_then_crash("window", tokenizer, tmp_path)
    snapshot = json.loads((tmp_path / "rank0" / TREE_FILE).read_text())
    assert snapshot["seq"] >= 2 and snapshot["nodes"]
    restarts_warm("window", tokenizer, tmp_path, reference, script, replies, pairs)


def test_reading_stops_at_the_first_bad_record(tmp_path):
    log = tmp_path / JOURNAL_FILE
    body = {"next_id": 1, "clock": 1, "nodes": [], "used": [], "gone": []}
    good = [journal.encode({**body, "seq": s}) for s in (1, 2, 3)]
    log.write_bytes(b"".join(good))
    assert [r["seq"] for r in journal.read(log, 0)[0]] == [1, 2, 3]
    # Records the snapshot holds (a crash mid-compaction) are skipped by number.
    assert [r["seq"] for r in journal.read(log, 2)[0]] == [3]
    flipped = bytearray(good[1])
    flipped[-3] ^= 0x20
    log.write_bytes(good[0] + bytes(flipped) + good[2])
    records, why = journal.read(log, 0)
    assert [r["seq"] for r in records] == [1] and why == "a record fails its checksum"
    log.write_bytes(good[0] + good[2])
    assert journal.read(log, 0) == ([journal.read(log, 0)[0][0]], "record 3 is out of sequence")
    log.write_bytes(good[0] + good[1][:5])
    assert journal.read(log, 0)[1] == "its last record is torn"
