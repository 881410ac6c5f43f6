"""The disk tier under its own budget: what it drops is the least recently used
on-disk leaf, read from the tree's order of non-resident leaves (no walk), the very
node a walk of the whole tree picks, and the chat's replies do not change."""

from __future__ import annotations

from exokv.cache.tier import is_disk
from exokv.engine import Engine, EngineOptions
from tests.test_cache_budget import chats, play, tokenizer  # noqa: F401
from tests.test_cache_kinds import KINDS, model_for
from tests.test_disk_tier import working_set


def test_the_disk_budget_drops_the_least_recently_used_on_disk_leaf(tokenizer, tmp_path):  # noqa: F811
    kind = "mla"
    reference, peak = working_set(kind, tokenizer)
    model, _ = model_for(kind)
    disk = peak // 4  # RAM holds a third, the disk a quarter: the disk must drop
    options = EngineOptions(
        budget=peak // 3, max_kv_size=KINDS[kind][1], disk_dir=str(tmp_path), disk_budget=disk
    )
    engine = Engine(model, tokenizer, options=options)
    tier = engine.coord.tier
    tree = engine.cache.tree
    dropped = []
    drop = tier.drop

    def checked_drop(node, reason):
        if reason == "disk budget":
            leaves = [n for n in tree.nodes() if is_disk(n) and not n.children and not n.locks]
            assert node is min(leaves, key=lambda n: (n.last_used, n.id))
            dropped.append(node.id)
        drop(node, reason)

    tier.drop = checked_drop
    kinds = []

    def within(result):
        assert all(held <= disk for held in tier.disk_bytes())
        assert engine.cache.total_bytes <= peak // 3
        kinds.extend(e.kind for e in result.events)
        tree.check()  # the orders kept as the tree changed equal a recount

    results = play(engine, chats(4, 2), check=within)
    assert len(dropped) >= 2 and "spill" in kinds and "load" in kinds
    assert [r.reply for r in results] == [r.reply for r in reference]
    # What was dropped is recomputed, never served wrong: fewer cached tokens, not more.
    assert all(
        r.cached_tokens <= ref.cached_tokens for r, ref in zip(results, reference, strict=True)
    )
