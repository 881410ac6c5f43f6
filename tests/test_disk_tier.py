"""The disk tier in one process: spill instead of evict, load instead of prefill, a
corrupt file a miss, a restart warm from disk, quantized KV (builtin:tiny and the
tiny models of every cache kind)."""

from __future__ import annotations

from pathlib import Path

import pytest

from exokv.cache import kinds
from exokv.cache.disk import decode, encode
from exokv.core.options import KvQuant
from exokv.rank.engine import Engine, EngineOptions
from tests.conftest import build_tiny_qwen
from tests.test_cache_budget import chats, engine_for, play, tokenizer  # noqa: F401
from tests.test_cache_kinds import KINDS, VOCAB, model_for

DISK = 10**9


def tiered(kind: str, tok, home: Path, budget: int | None, **extra) -> Engine:
    """An engine whose disk tier is rank 0's folder under `home`, its files in the
    pool beside it (kv_files)."""
    model, _ = model_for(kind)
    options = EngineOptions(
        budget=budget,
        max_kv_size=KINDS[kind][1],
        disk_dir=str(home / "rank0"),
        disk_budget=DISK,
        **extra,
    )
    return Engine(model, tok, options=options)


def kv_files(home: Path) -> list[Path]:
    """The KV files of the tiers under `home` (every pool's)."""
    return sorted(home.glob("pool-*/*.kv"))


def has_file(home: Path, node_id: int) -> bool:
    return any(f.name.startswith(f"{node_id}.L") for f in kv_files(home))


def working_set(kind: str, tok) -> tuple[list, int]:
    """The switch script's results unbudgeted, and the most bytes it held."""
    engine = engine_for(kind, tok)
    peak = 0

    def track(_):
        nonlocal peak
        peak = max(peak, engine.cache.total_bytes)

    return play(engine, chats(4, 2), check=track), peak


@pytest.mark.parametrize("kind", ["window", "state", "mixed-moe"])
def test_spilled_entries_come_back_with_equal_hits_and_replies(kind, tokenizer, tmp_path):  # noqa: F811
    reference, peak = working_set(kind, tokenizer)
    budget = peak // 3
    engine = tiered(kind, tokenizer, tmp_path, budget)
    kinds = []

    def within(result):
        assert engine.cache.total_bytes <= budget
        kinds.extend(e.kind for e in result.events)

    results = play(engine, chats(4, 2), check=within)
    assert [r.cached_tokens for r in results] == [r.cached_tokens for r in reference]
    assert [r.reply for r in results] == [r.reply for r in reference]
    assert "spill" in kinds and "load" in kinds and "evict" not in kinds


def test_a_corrupt_spilled_file_is_a_miss_with_the_right_reply(tokenizer, tmp_path):  # noqa: F811
    reference, peak = working_set("window", tokenizer)
    engine = tiered("window", tokenizer, tmp_path, peak // 3)
    script = chats(4, 2)
    first = play(engine, script[:4])
    engine.coord.tier.store.flush()
    files = kv_files(tmp_path)
    assert files
    for f in files:  # flip bytes in the middle of every spilled file
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0xFF
        f.write_bytes(bytes(data))
    replies = {r.session: [r.reply] for r in first}
    results = _second_half(engine, script, replies)
    assert [r.reply for r in results] == [r.reply for r in reference[4:]]
    drops = [e for r in results for e in r.events if e.kind == "drop"]
    assert drops and all("checksum" in e.reason for e in drops)
    assert any(
        r.cached_tokens < ref.cached_tokens for r, ref in zip(results, reference[4:], strict=True)
    )


def _second_half(engine: Engine, script: list, replies: dict) -> list:
    """The script's second turns, each conversation with its first reply."""
    from exokv.core.records import TurnRequest
    from tests.test_cache_budget import _with_replies

    out = []
    for session, messages in script[4:]:
        full = _with_replies(messages, replies[session])
        out.append(engine.turn(TurnRequest(session=session, messages=full, max_tokens=8)))
    return out


def _first_half_then_quit(tok, home: Path) -> tuple[list, list, dict, list]:
    """The 4-conversation script's first turns on a tiered engine that then closes:
    (the unbudgeted reference results, the script, replies per session, replies' tokens)."""
    reference, _ = working_set("state", tok)
    script = chats(4, 2)
    engine = tiered("state", tok, home, None)
    first = play(engine, script[:4])
    replies = {r.session: [r.reply] for r in first}
    pairs = [(r.reply, engine.reply_tokens(r.reply)) for r in first]
    engine.close()
    return reference, script, replies, pairs


def restarts_warm(kind: str, tok, home: Path, reference, script, replies, pairs) -> None:
    """A new engine on `home` runs the script's second half loading from disk, with the
    uninterrupted `reference`'s hits and replies."""
    again = tiered(kind, tok, home, None)
    assert again.tier_notice == ""
    again.remember_replies(pairs)
    results = _second_half(again, script, replies)
    assert all(any(e.kind == "load" for e in r.events) for r in results)
    assert [r.cached_tokens for r in results] == [r.cached_tokens for r in reference[4:]]
    assert [r.reply for r in results] == [r.reply for r in reference[4:]]


def test_restart_is_warm_from_disk(tokenizer, tmp_path):  # noqa: F811
    reference, script, replies, pairs = _first_half_then_quit(tokenizer, tmp_path)
    restarts_warm("state", tokenizer, tmp_path, reference, script, replies, pairs)


def test_file_checks():
    import mlx.core as mx

    obj = {"kv": [(mx.ones((1, 2, 3, 4)), (mx.zeros((1, 2, 3, 1)), mx.ones((2,))))], "s": [None]}
    data = encode(obj)
    back = decode(data)
    assert isinstance(back["kv"][0][1], tuple) and back["s"] == [None]
    assert mx.array_equal(back["kv"][0][0], obj["kv"][0][0])
    for bad in (data[:-3], data[:10], data[:40] + bytes([data[40] ^ 1]) + data[41:]):
        with pytest.raises(ValueError):
            decode(bad)


@pytest.mark.parametrize("bits", [8, 4])
def test_kv_bits_stores_fewer_bytes_per_token(bits, tokenizer, tmp_path):  # noqa: F811
    model = build_tiny_qwen(num_attention_heads=2, num_key_value_heads=2, vocab_size=VOCAB)
    full = Engine(model, tokenizer)
    quant = Engine(model, tokenizer, options=EngineOptions(kv=KvQuant(bits, 32)))
    assert quant.bytes_per_token < full.bytes_per_token * (0.6 if bits == 8 else 0.35)
    results = play(quant, chats(2, 2))
    assert results[-1].cached_tokens > 0 and all(r.reply for r in results)
    assert any(type(c).__name__ == "QuantizedKVCache" for c in quant._new_cache())
    assert kinds.offset(quant._new_cache()) == 0


def test_an_unreadable_persisted_tree_starts_cold_and_says_why(tokenizer, tmp_path):  # noqa: F811
    engine = tiered("window", tokenizer, tmp_path, None)
    play(engine, chats(1, 1))
    engine.close()
    assert (tmp_path / "rank0" / "tree.json").exists() and kv_files(tmp_path)
    (tmp_path / "rank0" / "tree.json").write_text("{not json")
    again = tiered("window", tokenizer, tmp_path, None)
    assert "unreadable" in again.tier_notice and "starting cold" in again.tier_notice
    assert not kv_files(tmp_path)  # files of no tree are removed
    assert play(again, chats(1, 1))[0].cached_tokens == 0


def test_one_chat_per_tier_directory(tokenizer, tmp_path, capsys):  # noqa: F811
    """A second engine on a tier directory in use runs from RAM and says which chat has it;
    once the first is closed, the next one gets the tier (and what the first left)."""
    import os

    first = tiered("window", tokenizer, tmp_path, None)
    play(first, chats(1, 1))
    second = tiered("window", tokenizer, tmp_path, None)
    err = capsys.readouterr().err
    assert second.coord.tier is None and first.coord.tier is not None
    assert f"in use by another exokv chat (pid {os.getpid()})" in err
    assert "RAM only" in err and len(err.strip().splitlines()) == 1
    first.close()
    third = tiered("window", tokenizer, tmp_path, None)
    assert third.coord.tier is not None and not third.tier_notice
    assert any(n.payload.tier == "disk" for n in third.cache.tree.nodes())


def test_a_file_of_other_positions_is_a_miss(tokenizer, tmp_path):  # noqa: F811
    """A whole, checksummed file holding other positions than the tree says (e.g. a
    node rewritten after a split, with an older tree.json left by a killed chat) is a
    miss on load, and the replies are right."""

    reference, script, replies, pairs = _first_half_then_quit(tokenizer, tmp_path)
    files = sorted(kv_files(tmp_path), key=lambda f: f.stat().st_size)
    # Every file now holds the positions of another entry (a valid file, the wrong one).
    contents = [f.read_bytes() for f in files]
    for f, data in zip(files, contents[1:] + contents[:1], strict=True):
        f.write_bytes(data)
    again = tiered("state", tokenizer, tmp_path, None)
    again.remember_replies(pairs)
    results = _second_half(again, script, replies)
    assert [r.reply for r in results] == [r.reply for r in reference[4:]]
    drops = [e for r in results for e in r.events if e.kind == "drop"]
    assert drops and all("unreadable contents" in e.reason for e in drops)


def test_a_full_disk_of_saved_copies_makes_room_for_a_spill(tokenizer, tmp_path):  # noqa: F811
    """/save copies count against the disk budget; when a spill finds no entry on disk to
    drop, the oldest copy's file goes (its entry stays in RAM) rather than the spill."""
    from exokv.core.records import TurnRequest
    from exokv.rank import kvsave
    from tests.test_cache_budget import _with_replies

    engine = tiered("window", tokenizer, tmp_path, None)
    script = chats(2, 2)
    first = play(engine, script[:2])
    tier = engine.coord.tier
    s0 = _with_replies(script[0][1], []) + [{"role": "assistant", "content": first[0].reply}]
    saved = kvsave.save_session(engine, "s0", s0)
    assert saved.tokens and tier.copies and tier.spills == 0
    tier.budget = tier.disk_bytes()[0]  # the disk is now full of s0's copies
    tier.budgets = [tier.budget]
    engine.coord.budget = engine.cache.total_bytes  # the next turn must evict
    copies = len(tier.copies)
    full = _with_replies(script[2][1], [first[0].reply])
    result = engine.turn(TurnRequest(session="s0", messages=full, max_tokens=8))
    spills = [e for e in result.events if e.kind == "spill"]
    assert spills and spills[0].session == "s1"
    assert len(tier.copies) < copies
    assert tier.disk_bytes()[0] <= tier.budget
    assert engine.cache.total_bytes <= engine.coord.budget


@pytest.mark.parametrize(
    ("given", "budgets", "no_cache", "want"),
    [
        (None, "", False, "auto"),  # on by default
        ("20GB", "", False, 20_000_000_000),
        ("0", "", False, 0),
        (None, "0", False, None),  # --cache-budget 0 keeps nothing: nothing to spill
        (None, "2MB,0KB", False, None),
        (None, "1MB,2MB", False, "auto"),
        ("20GB", "", True, None),  # --no-cache
    ],
)
def test_the_disk_tier_is_on_unless_the_chat_keeps_nothing(given, budgets, no_cache, want):
    from exokv.cache.tier_options import shown_disk_budget
    from exokv.frontend.start import ChatOptions, validate

    opts = ChatOptions("builtin:tiny", disk_budget=given, cache_budget=budgets or None)
    opts.no_cache = no_cache
    if "," in budgets:
        opts.ranks = 2
    cluster = validate(opts)
    assert cluster.disk_budget == want
    shown = shown_disk_budget(cluster)
    assert (shown is not None and shown > 0) == (want not in (None, 0))
