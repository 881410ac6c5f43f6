"""The disk tier reads the tree's orders, never walks it: under its own budget it drops
the least recently used on-disk leaf (the very node a walk of the whole tree picks,
and the chat's replies do not change), and a turn with half the tree on disk reads
its path and its evictions, not the tree."""

from __future__ import annotations

from exokv.cache.disk_tier import is_disk
from exokv.rank.engine import Engine, EngineOptions
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


def test_a_turns_bookkeeping_with_half_the_tree_on_disk_visits_what_changed():
    """10,000 nodes, the lower half of every other conversation on disk. One turn
    (match, touch, lock, the plan from the RAM-leaf order, 10 spills each making room
    by dropping the least recently used on-disk leaf, insert, unlock, the changed
    entries) reads a number of nodes bounded by its path and its evictions."""
    import random

    import tests.test_radix as tr
    from exokv.cache.coordinate import plan_tree

    rng = random.Random(0)
    tree = tr.CountingTree(size_of=lambda p: 0 if p is None else len(p), resident=tr.is_warm)
    convs = []
    for c in range(100):  # each conversation cut into its 100 turns of 5 tokens
        conv = [c * 1000 + 1] + [rng.randrange(50) for _ in range(499)]
        convs.append(conv)
        (node,), _ = tr.insert(tree, conv)
        while len(node.key) > 5:
            node = tree.split(node, len(node.key) - 5, tr.split_edge)
        if c != 7:  # conversation 7 is the live one, all in RAM
            for n in tree.match(conv).path[50:][::-1]:  # deepest first, as spills go
                tr.set_cold(tree, n, True, in_place=True)
    assert len(tree) == 10_000 and sum(1 for _ in tree.lru_nonresident()) == 99
    tree.drain_changed()

    prompt = convs[7] + [1, 2, 3]
    tr.VISITED = set()
    try:
        match, figures, ranks = tr.begin_turn(tree, prompt, over=50)
        evictions = plan_tree(tree, lambda n: [n.size], ranks, 1.0, set(match.path))
        for e in evictions:
            tree.remove_leaf(next(tree.lru_nonresident()))  # room on disk
            tr.set_cold(tree, tree.find(e.entry), True, in_place=True)  # the spill
        tr.insert(tree, prompt + [4, 5])
        tree.unlock(match.path)
        changed = tree.drain_changed()
        visited = len(tr.VISITED)
    finally:
        tr.VISITED = None
    assert figures[0] == 10_000 and len(evictions) == 10
    path = len(match.path)
    assert path == 100 and len(changed) <= path + 2 + 2 * len(evictions)
    # Each eviction reads its RAM leaf and parent, and the dropped on-disk leaf and
    # its parent; the path is read by match, touch, lock, insert and unlock.
    assert visited <= path + 4 * len(evictions) + 5, visited
    tree.check()
