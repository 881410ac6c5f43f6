"""A turn's bookkeeping as the cache grows: full walks of the tree versus the figures
the tree keeps as it changes, at 1k, 10k and 100k nodes; and the prompt render of a
long history, from scratch versus continued from the previous turn's.

    EXOKV_HOME=$(mktemp -d) python benchmarks/bookkeeping.py

No model runs: the tree part is pure Python (payloads are byte counts), the render
part uses builtin:tiny's tokenizer and template. Prints medians in milliseconds;
--json prints one JSON document instead.

--store: the state database's per-turn write (`Store.record_turn`, what a chat turn
commits) with `PRAGMA synchronous = NORMAL` and with FULL (what exokv runs), two
databases side by side, turns interleaved; and a disk-tier file write (synced, then
renamed) without and with the fsync of its directory. Run it where EXOKV_HOME is on
the disk you mean to measure (a tmpfs makes every fsync free).

The trees are shaped like the issue's measurement: conversations of --depth nodes
(a turn is one 50-token node, so the default 640 is a 32k-token conversation), as
many as make the tree's size. One turn of one conversation is: match its prompt,
touch and lock the path, read the figures the collective gathers (node count,
shape digest, bytes held), plan evictions, evict them, insert the prompt and the
reply, unlock, and list the entries the turn changed.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from exokv.cache.policy import Entry, RankLoad, _worst_rank, plan, plan_lru
from exokv.cache.radix import Node, RadixTree, common_prefix

TURN = 50  # tokens a turn adds: one node
BPT = 1000  # bytes a token holds on each rank (any number: only the sums matter)


# -- the former code paths, kept here to compare against -------------------------------


def old_common_prefix(a: Sequence[int], b: Sequence[int], start: int = 0) -> int:
    n = min(len(a), len(b) - start)
    i = 0
    while i < n and a[i] == b[start + i]:
        i += 1
    return i


def old_match(tree: RadixTree, tokens: Sequence[int]) -> list[Node]:
    node, pos, path = tree.root, 0, []
    while pos < len(tokens):
        child = node.children.get(tokens[pos])
        if child is None:
            break
        common = old_common_prefix(child.key, tokens, pos)
        path.append(child)
        pos += common
        if common < len(child.key):
            break
        node = child
    return path


def old_digest(nodes: Sequence[Node]) -> int:
    text = ";".join(f"{n.id}:{n.depth}:{n.parent.id if n.parent else -1}" for n in nodes)
    return zlib.crc32(text.encode())


def old_plan(entries, sizes, ranks, threshold) -> list[int]:
    """plan() before plan_lru: each eviction scans every entry for the LRU leaf."""
    index = {e.id: i for i, e in enumerate(entries)}
    children = {e.id: 0 for e in entries}
    for e in entries:
        if e.parent in children:
            children[e.parent] += 1
    held = [r.cache_bytes for r in ranks]
    freed = [0] * len(ranks)
    alive = set(index)
    out = []
    while _worst_rank(ranks, held, freed, threshold) is not None:
        leaves = [
            entries[index[i]] for i in alive if children[i] == 0 and not entries[index[i]].locked
        ]
        if not leaves:
            break
        victim = min(leaves, key=lambda e: (e.last_used, e.id))
        alive.remove(victim.id)
        if victim.parent in children:
            children[victim.parent] -= 1
        for r in range(len(ranks)):
            held[r] -= sizes[r][index[victim.id]]
            freed[r] += sizes[r][index[victim.id]]
        out.append(victim.id)
    return out


def old_render(tokenizer: Any, replies: dict[str, list[int]], messages: list[dict]) -> list[int]:
    """Engine.render before exokv.prompt.render: templates the history before every reply."""

    def template(ms):
        if not ms:
            return ""  # a reply first in the history has nothing before it
        return tokenizer.apply_chat_template(ms, add_generation_prompt=True, tokenize=False)

    def encode(text):
        return list(tokenizer.encode(text, add_special_tokens=False)) if text else []

    text = template(messages)
    tokens: list[int] = []
    pos = 0
    for i, message in enumerate(messages):
        reply = replies.get(message["content"]) if message["role"] == "assistant" else None
        if not reply:
            continue
        head = template(messages[:i])
        end = len(head) + len(message["content"])
        if (
            len(head) < pos
            or not text.startswith(head)
            or text[len(head) : end] != message["content"]
        ):
            continue
        tokens += encode(text[pos : len(head)]) + reply
        pos = end
    return tokens + encode(text[pos:])


# -- trees ------------------------------------------------------------------------------


def split_bytes(payload: int, k: int) -> tuple[int, int]:
    return k * BPT, payload - k * BPT


def build(nodes: int, depth: int, seed: int) -> tuple[RadixTree, list[list[int]]]:
    """Conversations of `depth` turns of TURN tokens each; one node per turn."""
    rng = random.Random(seed)
    tree = RadixTree(size_of=lambda p: p or 0)
    convs = []
    for c in range(max(1, round(nodes / depth))):
        conv = [1000 + c] + [rng.randrange(256) for _ in range(depth * TURN - 1)]
        convs.append(conv)
        (node,), _ = tree.insert(conv, lambda a, b: (b - a) * BPT, split_bytes)
        while len(node.key) > TURN:  # cut it into turns, the first turn at the top
            node = tree.split(node, len(node.key) - TURN, split_bytes)
        for n in tree.match(conv).path:  # used turn by turn, one after another
            tree.touch([n])
    tree.drain_changed()
    return tree, convs


def entry(node: Node) -> Entry:
    return Entry(node.id, node.parent.id if node.parent else None, node.last_used, node.locks > 0)


def loads_for(tree: RadixTree, evictions: int, ranks: int = 2) -> list[RankLoad]:
    """Budgets that make the plan evict about `evictions` leaves of one turn each."""
    held = tree.weight
    over = evictions * TURN * BPT - TURN * BPT // 2
    return [
        RankLoad(cache_bytes=held, budget=max(0, held - over), pressure=0.0, ram=1 << 40)
        for _ in range(ranks)
    ]


def new_plan(tree: RadixTree, loads: list[RankLoad]) -> list[int]:
    find = tree.find

    def parent_entry(i: int) -> Entry | None:
        node = find(i)
        return None if node is None else entry(node)

    return [
        e.entry
        for e in plan_lru(
            (entry(n) for n in tree.lru_leaves()),
            entry=parent_entry,
            children=lambda i: len(find(i).children),
            sizes_of=lambda i: [find(i).size] * len(loads),
            ranks=loads,
            threshold=1.0,
        )
    ]


def full_plan(tree: RadixTree, loads: list[RankLoad], planner: Callable) -> list:
    nodes = list(tree.nodes())
    entries = [entry(n) for n in nodes]
    sizes = [[n.size for n in nodes] for _ in loads]
    return planner(entries, sizes, loads, 1.0)


def timed(fn: Callable[[], Any], repeat: int) -> float:
    """Median milliseconds of fn() over `repeat` runs."""
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1000)
    return statistics.median(times)


def turn_incremental(tree: RadixTree, conv: list[int], reply: list[int], evictions: int) -> int:
    """One turn's bookkeeping with the incremental figures; returns entries reported."""
    prompt = conv + reply[:10]
    match = tree.match(prompt)
    tree.touch(match.path)
    tree.lock(match.path)
    _gathered = (len(tree), tree.digest, tree.weight)
    for i in new_plan(tree, loads_for(tree, evictions)):
        tree.remove_leaf(tree.find(i))
    tree.insert(prompt + reply, lambda a, b: (b - a) * BPT, split_bytes)
    tree.unlock(match.path)
    reported = [(n.id, n.size, n.last_used) for n in tree.drain_changed()]
    return len(reported)


def turn_full_walk(tree: RadixTree, conv: list[int], reply: list[int], evictions: int) -> int:
    """The same turn as the engine did it before: walks of the whole tree."""
    prompt = conv + reply[:10]
    path = old_match(tree, prompt)
    tree.touch(path)
    tree.lock(path)
    nodes = list(tree.nodes())
    _gathered = (len(nodes), old_digest(nodes), sum(n.size for n in nodes))
    for i in full_plan(tree, loads_for(tree, evictions), old_plan):
        tree.remove_leaf(tree.find(i))
    tree.insert(prompt + reply, lambda a, b: (b - a) * BPT, split_bytes)
    tree.unlock(path)
    reported = [(n.id, n.size, n.last_used) for n in tree.nodes()]
    return len(reported)


def bench_tree(size: int, depth: int, repeat: int, seed: int) -> dict[str, Any]:
    tree, convs = build(size, depth, seed)
    rng = random.Random(seed + 1)
    row: dict[str, Any] = {"nodes": len(tree), "path": depth}
    conv = convs[len(convs) // 2]
    prompt = conv + [7] * 10
    few = max(1, repeat // 2)  # the full walks are slow at 100k nodes
    row["match_ms"] = timed(lambda: tree.match(prompt), repeat)
    row["match_old_ms"] = timed(lambda: old_match(tree, prompt), repeat)
    row["figures_ms"] = timed(lambda: (len(tree), tree.digest, tree.weight), repeat)
    nodes = list(tree.nodes())
    row["figures_old_ms"] = timed(
        lambda: (len(nodes), old_digest(list(tree.nodes())), sum(n.size for n in nodes)), few
    )
    row["lru_first_ms"] = timed(lambda: next(tree.lru_leaves()), repeat)
    for e in (10, 100):
        loads = loads_for(tree, e)
        got = new_plan(tree, loads)
        assert len(got) == e, (len(got), e)
        assert got == [x.entry for x in full_plan(tree, loads, plan)]
        row[f"plan{e}_ms"] = timed(lambda loads=loads: new_plan(tree, loads), repeat)
        row[f"plan{e}_adapter_ms"] = timed(lambda loads=loads: full_plan(tree, loads, plan), few)
        row[f"plan{e}_old_ms"] = timed(lambda loads=loads: full_plan(tree, loads, old_plan), few)
    replies = [[rng.randrange(256) for _ in range(TURN)] for _ in range(repeat + few)]
    times = []
    for i in range(repeat):
        c = convs[i % len(convs)]
        t = time.perf_counter()
        turn_incremental(tree, c, replies[i], 10)
        times.append((time.perf_counter() - t) * 1000)
        convs[i % len(convs)] = c + replies[i]
    row["turn10_ms"] = statistics.median(times)
    times = []
    for i in range(few):
        c = convs[i % len(convs)]
        t = time.perf_counter()
        turn_full_walk(tree, c, replies[repeat + i], 10)
        times.append((time.perf_counter() - t) * 1000)
        convs[i % len(convs)] = c + replies[repeat + i]
    row["turn10_old_ms"] = statistics.median(times)
    tree.check()
    return row


# -- render -----------------------------------------------------------------------------


def bench_render(contexts: list[int], repeat: int, seed: int) -> list[dict[str, Any]]:
    from mlx_lm.utils import load_tokenizer

    from exokv.model.builtin import ensure_builtin
    from exokv.prompt.render import PromptRenderer

    tokenizer = load_tokenizer(ensure_builtin("tiny"))
    rng = random.Random(seed)
    words = "river stone light window garden paper music winter orange signal".split()
    renderer = PromptRenderer(tokenizer)
    replies: dict[str, list[int]] = {}  # what the old render looked replies up in
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are terse."}]
    rows = []
    few = max(1, repeat // 2)
    targets = sorted(contexts)
    while targets:
        messages.append({"role": "user", "content": " ".join(rng.choices(words, k=40))})
        before = OrderedDict(renderer._rendered)  # the renders of the earlier turns
        tokens = renderer.render(messages)
        if len(tokens) >= targets[0]:
            targets.pop(0)
            ms = list(messages)
            assert tokens == old_render(tokenizer, replies, ms), "renders differ"
            new = []
            for _ in range(repeat):
                again = PromptRenderer(tokenizer)
                again._rendered = OrderedDict(before)
                t = time.perf_counter()
                again.render(ms)
                new.append((time.perf_counter() - t) * 1000)
            old_ms = timed(lambda ms=ms: old_render(tokenizer, replies, ms), few)
            rows.append(
                {
                    "tokens": len(tokens),
                    "turns": len(ms) // 2,
                    "render_ms": statistics.median(new),
                    "render_old_ms": old_ms,
                }
            )
        ids = [rng.randrange(3, 500) for _ in range(55)]
        text = tokenizer.decode(ids)
        replies[text] = ids  # the message carries them to the new render
        messages.append({"role": "assistant", "content": text, "tokens": ids})
    return rows


def _split_empty(payload: Any, k: int) -> tuple[Any, Any]:
    from exokv.cache.prefix_cache import Payload

    return Payload(start=payload.start), Payload(start=payload.start + k)


def bench_engine(
    sizes: list[int],
    depth: int,
    repeat: int,
    seed: int,
    disk: bool = False,
    journal: bool = False,
) -> list[dict[str, Any]]:
    """Engine.turn on builtin:tiny with the tree padded to `size` nodes: overhead_s
    and TTFT of a short cached turn. The padding is other conversations' nodes
    holding no K/V (empty payloads): the turn's own K/V is real.

    With `disk`, a disk tier is on and full: the lower half of every padding
    conversation is on disk, the padding is counted in the RAM budget (as tokens
    times the measured bytes per token) and both budgets are what is held after
    padding, so every turn spills RAM leaves and every spill drops on-disk leaves.

    With `journal`, the same tier with room on disk for the turns' writes, twice side
    by side (turns alternating): with write-through and the journal (each turn's
    `DiskTier.after_turn`), steady as after many turns (every padding node in RAM has
    its copy, the snapshot holds the padding), and without them (`after_turn` does
    nothing, as before they were built: every spill writes its file)."""
    from mlx_lm import load

    from exokv.model.builtin import ensure_builtin

    model, tokenizer = load(str(ensure_builtin("tiny")))
    rows = []
    for size in sizes:
        variants = [(True, True), (True, False)] if journal else [(disk, None)]
        runs = [_PaddedEngine(model, tokenizer, size, depth, seed, on, wt) for on, wt in variants]
        for t in range(repeat + 1):
            for run in runs:
                run.turn(t)
        for run in runs:
            rows.append(run.row())
    return rows


class _PaddedEngine:
    ROOM = 256 << 20  # disk bytes free for the turns' writes (with `journal`)

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        size: int,
        depth: int,
        seed: int,
        disk: bool,
        wt: bool | None,
    ) -> None:
        import tempfile

        from exokv.cache.prefix_cache import Payload
        from exokv.rank.engine import Engine, EngineOptions

        self.tmp = tempfile.TemporaryDirectory(prefix="exokv-bench-disk-")
        options = EngineOptions(disk_dir=self.tmp.name, disk_budget=1) if disk else None
        self.engine = engine = Engine(model, tokenizer, options=options)
        rng = random.Random(seed)
        pad = engine.cache.tree
        ends = []
        for c in range(max(1, round(size / depth))):
            conv = [100_000 + c] + [rng.randrange(256) for _ in range(depth * TURN - 1)]
            (node,), _ = pad.insert(conv, lambda a, b: Payload(start=a), _split_empty)
            ends.append(node)
            while len(node.key) > TURN:
                node = pad.split(node, len(node.key) - TURN, _split_empty)
        self.padded = sum(1 for _ in pad.nodes())
        self.disk, self.write_through = disk, wt
        if disk:
            _spill_padding(engine, ends)
            tier = engine.coord.tier
            if wt is not None:  # None: the tier as it is, full
                if wt:
                    _written_through(engine)
                else:
                    tier.after_turn = lambda changed: None
                tier.budget = tier.disk_bytes()[0] + self.ROOM
        self.messages = [{"role": "system", "content": "You are terse."}]
        self.overheads: list[float] = []
        self.ttfts: list[float] = []
        self.walls: list[float] = []

    def turn(self, t: int) -> None:
        from exokv.core.records import TurnRequest

        self.messages.append({"role": "user", "content": f"question {t} about rivers"})
        request = TurnRequest(session="s", messages=list(self.messages), max_tokens=8)
        wall = time.perf_counter()
        result = self.engine.turn(request)
        wall = time.perf_counter() - wall
        self.messages.append({"role": "assistant", "content": result.reply})
        if t:  # the first turn fills the cache
            self.overheads.append(result.overhead_s * 1000)
            self.ttfts.append(result.ttft_s * 1000)
            self.walls.append(wall * 1000)

    def row(self) -> dict[str, Any]:
        row: dict[str, Any] = {
            "nodes": self.padded,
            "overhead_ms": statistics.median(self.overheads),
            "ttft_ms": statistics.median(self.ttfts),
            "turn_ms": statistics.median(self.walls),
        }
        if self.disk:
            tier = self.engine.coord.tier
            pad = self.engine.cache.tree
            on_disk = sum(1 for n in pad.nodes() if n.payload.tier == "disk")
            row.update(on_disk=on_disk, spills=tier.spills, drops=tier.drops)
            row.update(write_through=self.write_through, journal_seq=tier.journal.seq)
            tier.store.flush()
        self.tmp.cleanup()
        return row


def _written_through(engine: Any) -> None:
    """As after many turns of write-through: every RAM padding node has its copy (no
    files: the turns never read them) and the snapshot holds the whole padding."""
    tier, tree = engine.coord.tier, engine.cache.tree
    for node in tree.nodes():
        if node.payload.tier == "ram":
            tier._keep_as_copy(node)
    tier.persist()
    tree.drain_changed()


def _spill_padding(engine: Any, ends: list[Node]) -> None:
    """Count the padding in the cache's figures, put the lower half of each padding
    conversation on disk (no files: the turns never read them) and make both budgets
    what is held now, so the cache is full in RAM and on disk."""
    cache, tier = engine.cache, engine.coord.tier
    for node in cache.tree.nodes():
        cache._account(cache.counts(node), 0, {}, 0)
    for end in ends:
        path = []
        while end.parent is not None:
            path.append(end)
            end = end.parent
        for node in path[: len(path) // 2]:  # deepest first: on-disk nodes stay below RAM
            cache.detach(node)
            tier._count(node, +1)
    engine.coord.budget = engine.coord.held_bytes()[0]
    tier.budget = tier.disk_bytes()[0]


def bench_common_prefix(tokens: int, repeat: int) -> dict[str, Any]:
    a = tuple(random.Random(0).randrange(256) for _ in range(tokens))
    b = list(a) + [1]
    assert common_prefix(a, b) == old_common_prefix(a, b) == tokens
    return {
        "tokens": tokens,
        "slices_ms": timed(lambda: common_prefix(a, b), repeat),
        "token_by_token_ms": timed(lambda: old_common_prefix(a, b), repeat),
    }


# -- durability -------------------------------------------------------------------------


def bench_store(turns: int, seed: int) -> dict[str, Any]:
    """Store.record_turn under synchronous NORMAL and FULL, interleaved turn by turn, in
    two databases under EXOKV_HOME; then a disk-tier file's write and rename without and
    with the directory's sync, interleaved. Medians in ms."""
    import os
    import tempfile
    from pathlib import Path

    from exokv.cache import durable
    from exokv.config import exokv_home
    from exokv.core.records import CacheEvent, EntryInfo, RankStats, TurnResult
    from exokv.state import connection
    from exokv.state.store import Store

    base = exokv_home()
    base.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    stores = {}
    for mode in ("NORMAL", "FULL"):
        connection.SYNCHRONOUS = mode  # read when a database is opened
        stores[mode] = Store.open(Path(tempfile.mkdtemp(prefix=f"sync-{mode}-", dir=base)))
    connection.SYNCHRONOUS = "FULL"
    runs = {
        mode: store.start_run("builtin:tiny", 2, [None, None]) for mode, store in stores.items()
    }
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are terse."}]
    times: dict[str, list[float]] = {mode: [] for mode in stores}
    for t in range(turns + 1):
        messages.append({"role": "user", "content": f"question {t} " + "word " * 40})
        messages.append({"role": "assistant", "content": "reply " * 60, "tokens": list(range(60))})
        events = [
            CacheEvent(kind, t, t * 2 + i, 50, [50_000, 50_000], session="s")
            for i, kind in enumerate(("hit", "add", "evict"))
        ]
        entries = [
            EntryInfo(t * 2 + i, t * 2 - 1, "s", 50, 50 * (t + 1), [50_000, 50_000], 1, t)
            for i in range(2)
        ]
        stats = [RankStats(r, 1 << 24, 2 * t, None, 0.3, 1 << 34, 1 << 30, 1 << 24) for r in (0, 1)]
        result = TurnResult(
            "s",
            "reply",
            4000,
            3900,
            100,
            60,
            0.05,
            40.0,
            0.001,
            2,
            events=events,
            rank_stats=stats,
            entries=entries,
        )
        order = list(stores)
        rng.shuffle(order)  # neither mode always second
        for mode in order:
            start = time.perf_counter()
            stores[mode].record_turn(runs[mode], "s", messages, result, "builtin:tiny")
            if t:  # the first turn creates the session
                times[mode].append((time.perf_counter() - start) * 1000)
    for store in stores.values():
        store.close()
    row: dict[str, Any] = {"turns": turns}
    for mode, ms in times.items():
        row[f"record_turn_{mode.lower()}_ms"] = statistics.median(ms)
        row[f"record_turn_{mode.lower()}_p90_ms"] = sorted(ms)[int(0.9 * (len(ms) - 1))]

    folder = Path(tempfile.mkdtemp(prefix="sync-files-", dir=base))
    data = os.urandom(256 << 10)  # a node's file: 256 KB
    files: dict[str, list[float]] = {"rename": [], "rename_dir_sync": []}
    for i in range(turns):
        for kind in files:
            tmp, final = folder / f"{kind}-{i}.tmp", folder / f"{kind}-{i}.kv"
            start = time.perf_counter()
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                durable.sync_file(f.fileno())
            if kind == "rename":
                os.replace(tmp, final)
            else:
                durable.replace(tmp, final)
            files[kind].append((time.perf_counter() - start) * 1000)
    row["file_write_ms"] = statistics.median(files["rename"])
    row["file_write_dir_sync_ms"] = statistics.median(files["rename_dir_sync"])
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1000,10000,100000", help="tree sizes in nodes")
    ap.add_argument("--depth", type=int, default=640, help="nodes per conversation")
    ap.add_argument("--contexts", default="8000,16000,32000", help="render: history tokens")
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-render", action="store_true", help="skip the render part")
    ap.add_argument("--no-tree", action="store_true", help="skip the tree part")
    ap.add_argument(
        "--engine", action="store_true", help="also: Engine.turn's overhead_s in padded trees"
    )
    ap.add_argument(
        "--disk",
        action="store_true",
        help="with --engine: a full disk tier under a full RAM budget (spills and drops each turn)",
    )
    ap.add_argument(
        "--journal",
        action="store_true",
        help="with --engine: a disk tier with room, with write-through and the journal and"
        " without them, side by side",
    )
    ap.add_argument(
        "--store",
        action="store_true",
        help="also: the store's per-turn commit with synchronous NORMAL and FULL, side by side",
    )
    ap.add_argument("--store-turns", type=int, default=200, help="turns for --store")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    sizes = [int(s) for s in args.sizes.split(",")]
    doc: dict[str, Any] = {}
    if not args.no_tree:
        doc["trees"] = [bench_tree(s, min(args.depth, s), args.repeat, args.seed) for s in sizes]
        doc["common_prefix"] = bench_common_prefix(32000, args.repeat * 3)
    if not args.no_render:
        contexts = [int(c) for c in args.contexts.split(",")]
        doc["render"] = bench_render(contexts, args.repeat, args.seed)
    if args.engine:
        doc["engine"] = bench_engine(
            sizes, args.depth, args.repeat, args.seed, args.disk or args.journal, args.journal
        )
    if args.store:
        doc["store"] = bench_store(args.store_turns, args.seed)
    if args.json:
        print(json.dumps(doc, indent=2))
        return
    print_tables(doc)


def print_tables(doc: dict[str, Any]) -> None:
    cols = [
        ("nodes", "nodes"),
        ("match", "match_ms"),
        ("match old", "match_old_ms"),
        ("figures", "figures_ms"),
        ("figures old", "figures_old_ms"),
        ("LRU leaf", "lru_first_ms"),
        ("plan 10", "plan10_ms"),
        ("plan 10 old", "plan10_old_ms"),
        ("plan 100", "plan100_ms"),
        ("plan() 100", "plan100_adapter_ms"),
        ("plan 100 old", "plan100_old_ms"),
        ("turn", "turn10_ms"),
        ("turn old", "turn10_old_ms"),
    ]
    if "trees" in doc:
        print("tree bookkeeping, median ms (old: full walks, as before)")
        print(" | ".join(h for h, _ in cols))
        for row in doc["trees"]:
            print(" | ".join(_fmt(row[k]) for _, k in cols))
        cp = doc["common_prefix"]
        print(
            f"\ncommon_prefix of {cp['tokens']} tokens: {cp['slices_ms']:.3f} ms by slices, "
            f"{cp['token_by_token_ms']:.3f} ms token by token"
        )
    if "render" in doc:
        print("\nrender, median ms: tokens | turns | continued | from scratch")
        for row in doc["render"]:
            print(
                f"{row['tokens']} | {row['turns']} | {row['render_ms']:.2f} | "
                f"{row['render_old_ms']:.1f}"
            )

    if "engine" in doc:
        disk = "on_disk" in doc["engine"][0]
        print(
            "\nEngine.turn on builtin:tiny, median ms: nodes | overhead_s | TTFT | whole turn"
            + (" | on disk | spills | drops | write-through and journal" if disk else "")
        )
        for row in doc["engine"]:
            wt = {True: "on", False: "off", None: "-"}[row.get("write_through")]
            more = f" | {row['on_disk']} | {row['spills']} | {row['drops']} | {wt}" if disk else ""
            print(
                f"{row['nodes']} | {row['overhead_ms']:.2f} | {row['ttft_ms']:.1f} | "
                f"{row['turn_ms']:.1f}{more}"
            )
    if "store" in doc:
        st = doc["store"]
        print(
            f"\nStore.record_turn over {st['turns']} turns, interleaved, median (p90) ms: "
            f"synchronous NORMAL {st['record_turn_normal_ms']:.2f} "
            f"({st['record_turn_normal_p90_ms']:.2f}), "
            f"FULL {st['record_turn_full_ms']:.2f} ({st['record_turn_full_p90_ms']:.2f})"
        )
        print(
            f"a 256 KB disk-tier file, synced and renamed, median ms: {st['file_write_ms']:.2f}, "
            f"with the directory's sync {st['file_write_dir_sync_ms']:.2f}"
        )


def _fmt(x: Any) -> str:
    if isinstance(x, int):
        return str(x)
    return f"{x:.3f}" if x < 10 else f"{x:.0f}"


if __name__ == "__main__":
    main()
