"""One chat turn, run identically on every rank.

render -> fetch the longest cached prefix -> one collective -> evict by plan ->
prefill only the new tokens -> decode -> insert. Every cache decision is made
from the token sequences (identical everywhere) and the gathered numbers.
"""

from __future__ import annotations

import time
import zlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_sampler

from exokv.cache import memory
from exokv.cache.policy import Entry, RankLoad, plan
from exokv.cache.prefix_cache import Hit, PrefixCache
from exokv.cache.radix import Node
from exokv.cluster.group import Group, LocalGroup
from exokv.config import DEFAULT_MEMORY_THRESHOLD
from exokv.errors import ExokvError
from exokv.records import CacheEvent, EntryInfo, RankStats, TurnRequest, TurnResult

PREFILL_STEP = 512
STOP_CHECK_EVERY = 4  # decode tokens between stop checks when there are several ranks
MAX_REMEMBERED_REPLIES = 4096  # replies whose exact tokens render() reuses
_DIGEST = 8  # index of the tree digest; per-entry sizes follow it in the gathered vector


class PromptTooLong(ExokvError):
    """A prompt longer than the model's context, refused before any of it is computed.

    Decided from the prompt's tokens and the model's config alone, so every rank
    refuses the same turn, before the turn's first collective.
    """


def _quiet_tokenizer_warnings() -> None:
    # transformers warns on stderr about a prompt over its maximum length; exokv
    # refuses such a prompt itself (PromptTooLong), in one line.
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return
    hf_logging.set_verbosity_error()


@dataclass
class EngineOptions:
    budget: int | None = None  # this rank's --cache-budget; None: derived from RAM
    memory_threshold: float = DEFAULT_MEMORY_THRESHOLD
    max_kv_size: int | None = None
    seed: int | None = None


class Engine:
    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        group: Group | None = None,
        options: EngineOptions | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.group = group or LocalGroup()
        self.options = options or EngineOptions()
        self.cache = PrefixCache(self._new_cache)
        self._replies: OrderedDict[str, list[int]] = OrderedDict()
        self._eos = set(tokenizer.eos_token_ids)
        self.decision = 0
        self.collectives = 0
        _quiet_tokenizer_warnings()
        context = getattr(getattr(model, "args", None), "max_position_embeddings", None)
        self.context: int | None = context if isinstance(context, int) and context > 0 else None
        if self.options.seed is not None:
            mx.random.seed(self.options.seed)
        self.bytes_per_token = self._measure_bytes_per_token()
        ram = memory.sample(self.group.rank).ram_total
        model_bytes = sum(v.nbytes for _, v in _flat_params(model))
        self.budget = (
            self.options.budget
            if self.options.budget is not None
            else memory.default_budget(self.options.memory_threshold, ram, model_bytes)
        )

    # -- the turn ---------------------------------------------------------------

    def render(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """The prompt's tokens, with each earlier reply as the exact tokens generated.

        Decoding a reply and encoding it again can give other tokens (BPE picks one
        split of the text), which would end the cache match at the first reply. Like
        `mlx_lm.chat`, which carries its cache, the model is shown what it produced.
        Used with and without the cache alike, so replies stay the same either way.
        """
        messages = list(messages)
        text = self._template(messages, generation_prompt=True)
        tokens: list[int] = []
        pos = 0
        for i, message in enumerate(messages):
            reply = (
                self._replies.get(message["content"]) if message["role"] == "assistant" else None
            )
            if not reply:
                continue
            # Where the reply starts: right after the history before it and its header.
            head = self._template(messages[:i], generation_prompt=True)
            end = len(head) + len(message["content"])
            if (
                len(head) < pos
                or not text.startswith(head)
                or text[len(head) : end] != message["content"]
            ):
                continue
            tokens += self._encode(text[pos : len(head)]) + reply
            pos = end
        return tokens + self._encode(text[pos:])

    def _template(self, messages: list[dict[str, str]], generation_prompt: bool) -> str:
        if not messages:
            return ""
        return self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=generation_prompt, tokenize=False
        )

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False)) if text else []

    def _remember_reply(self, reply: str, generated: list[int]) -> None:
        tokens = [t for t in generated if t not in self._eos]
        if reply and tokens:
            self._replies[reply] = tokens
            self._replies.move_to_end(reply)
            while len(self._replies) > MAX_REMEMBERED_REPLIES:
                self._replies.popitem(last=False)

    def turn(
        self,
        request: TurnRequest,
        on_text: Callable[[str], None] | None = None,
        on_progress: Callable[[int, int], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> TurnResult:
        start = time.perf_counter()
        tokens = self.render(request.messages)
        if self.context is not None and len(tokens) > self.context:
            raise PromptTooLong(
                f"the prompt is {len(tokens):,} tokens and the model's context is "
                f"{self.context:,}: not run (shorten the message, or /new to leave the "
                "earlier turns behind)"
            )
        self.decision += 1
        events: list[CacheEvent] = []
        overhead = time.perf_counter()
        hit = (
            self.cache.fetch(tokens)
            if request.use_cache
            else Hit(cache=self._new_cache(), length=0, path=[])
        )
        try:
            if hit.entry is not None:
                events.append(self._event("hit", hit.entry, [], request.session, hit.length))
            new_tokens = len(tokens) - hit.length + request.max_tokens
            per_rank_bpt, stats = self._coordinate(new_tokens, request.session, events)
            overhead = time.perf_counter() - overhead
            todo = tokens[hit.length : -1]
            stopped = self._prefill(
                hit.cache, todo, hit.length, len(tokens), on_progress, should_stop
            )
            if stopped:
                # Stopped during prefill (Ctrl-C): no reply; what was prefilled is kept below.
                generated, reply, finish, ttft, tps = [], "", "interrupted", 0.0, 0.0
            else:
                if request.use_cache and self.cache.mode == "snapshots":
                    # Turn boundary: the next turn's prompt extends this one.
                    self.cache.insert(tokens[:-1], hit.cache, request.session)
                generated, reply, finish, ttft, tps = self._decode(
                    tokens[-1:], hit.cache, request, start, on_text, should_stop
                )
        finally:
            if request.use_cache:
                self.cache.release(hit)
        self._remember_reply(reply, generated)
        tic = time.perf_counter()
        if request.use_cache:
            added, split = self.cache.insert(tokens + generated, hit.cache, request.session)
            for node in split:
                events.append(self._event("update", node, per_rank_bpt, request.session))
            for node in added:
                events.append(self._event("add", node, per_rank_bpt, request.session))
        overhead += time.perf_counter() - tic
        self._count_added(stats, events)
        return TurnResult(
            session=request.session,
            reply=reply,
            prompt_tokens=len(tokens),
            cached_tokens=hit.length,
            prefilled_tokens=len(tokens) - hit.length,
            generated_tokens=len(generated),
            ttft_s=ttft,
            decode_tps=tps,
            overhead_s=overhead,
            ranks=self.group.size,
            finish_reason=finish,
            decision=self.decision,
            events=events,
            rank_stats=stats,
            entries=self.entries(per_rank_bpt),
        )

    # -- saving and loading a prefix (exokv.chat.kvsave) -------------------------

    def reply_tokens(self, reply: str) -> list[int] | None:
        """The exact tokens `render` uses for an earlier reply, if remembered."""
        tokens = self._replies.get(reply)
        return list(tokens) if tokens else None

    def remember_replies(self, pairs: Sequence[tuple[str, Sequence[int]]]) -> None:
        """Restore replies' exact tokens (a resumed session), so `render` is as before."""
        for reply, tokens in pairs:
            self._remember_reply(reply, list(tokens))

    def export_prefix(self, tokens: Sequence[int]) -> tuple[list[int], list[Any]]:
        """The longest cached prefix of `tokens` and a fresh cache holding exactly it.

        For saving: the stored entries are not changed and get no hit (LRU is touched).
        """
        hit = self.cache.fetch([*tokens, -1])  # -1 is never a token: the whole match counts
        try:
            for node in hit.path:
                node.hits -= 1
            return list(tokens[: hit.length]), hit.cache
        finally:
            self.cache.release(hit)

    def import_prefix(
        self, tokens: Sequence[int], cache: list[Any], session: str
    ) -> list[CacheEvent]:
        """Insert a loaded cache holding `tokens`; every rank calls it alike (one gather)."""
        per_rank_bpt = [float(row[0]) for row in self.group.gather([self.bytes_per_token])]
        added, split = self.cache.insert(tokens, cache, session)
        events = [self._event("update", n, per_rank_bpt, session) for n in split]
        events += [self._event("add", n, per_rank_bpt, session) for n in added]
        for e in events:
            e.reason = "loaded from a saved cache"
        return events

    # -- the one collective and the plan ---------------------------------------

    def _coordinate(
        self, new_tokens: int, session: str, events: list[CacheEvent]
    ) -> tuple[list[float], list[RankStats]]:
        """Gather every rank's numbers once, plan, and evict the same entries everywhere."""
        nodes = list(self.cache.tree.nodes())
        probe = memory.sample(self.group.rank)
        headroom = new_tokens * self.bytes_per_token
        if self.cache.mode == "snapshots":
            headroom *= 2  # a snapshot after prefill and another after decode
        local = [
            self.cache.total_bytes,
            -1 if self.budget is None else self.budget,
            int(probe.pressure * 1_000_000),
            probe.ram_total,
            headroom,
            probe.rss,
            probe.mlx_active,
            self.bytes_per_token,
            _tree_digest(nodes),
        ]
        if self.cache.mode == "snapshots":
            local += [self.cache.entry_bytes(n) for n in nodes]
        self.collectives += 1
        rows = self.group.gather(local)
        digests = {row[_DIGEST] for row in rows}
        if len(digests) != 1:
            raise ExokvError("ranks hold different cache trees (they diverged); restart the chat")
        per_rank_bpt = [float(row[7]) for row in rows]
        sizes = [
            row[_DIGEST + 1 :]
            if self.cache.mode == "snapshots"
            else [len(n.key) * row[7] for n in nodes]
            for row in rows
        ]
        loads = [
            RankLoad(
                cache_bytes=row[0],
                budget=None if row[1] < 0 else row[1],
                pressure=row[2] / 1_000_000,
                ram=row[3],
                headroom=row[4],
            )
            for row in rows
        ]
        entries = [
            Entry(
                id=n.id,
                parent=n.parent.id if n.parent is not None else None,
                last_used=n.last_used,
                locked=n.locks > 0,
            )
            for n in nodes
        ]
        pressures = [load.pressure for load in loads]
        by_id = {n.id: i for i, n in enumerate(nodes)}
        for eviction in plan(entries, sizes, loads, self.options.memory_threshold):
            i = by_id[eviction.entry]
            node = nodes[i]
            events.append(
                CacheEvent(
                    kind="evict",
                    decision=self.decision,
                    entry=node.id,
                    tokens=len(node.key),
                    bytes=[int(sizes[r][i]) for r in range(len(rows))],
                    session=node.session,
                    reason=eviction.reason,
                    pressures=pressures,
                )
            )
            self.cache.evict(node)
        freed = [0] * len(rows)
        for e in events:
            if e.kind == "evict":
                freed = [f + b for f, b in zip(freed, e.bytes, strict=True)]
        stats = [
            RankStats(
                rank=r,
                cache_bytes=row[0] - freed[r],
                entries=len(nodes) - sum(1 for e in events if e.kind == "evict"),
                budget=None if row[1] < 0 else row[1],
                pressure=row[2] / 1_000_000,
                ram_total=row[3],
                rss=row[5],
                mlx_active=row[6],
            )
            for r, row in enumerate(rows)
        ]
        return per_rank_bpt, stats

    def _count_added(self, stats: list[RankStats], events: list[CacheEvent]) -> None:
        """Bring the gathered per-rank numbers up to date with what this turn inserted."""
        for e in events:
            if e.kind == "add":
                for s in stats:
                    s.cache_bytes += e.bytes[s.rank]
                    s.entries += 1
        stats[self.group.rank].cache_bytes = self.cache.total_bytes

    # -- model work -------------------------------------------------------------

    def _prefill(
        self,
        cache: list[Any],
        tokens: Sequence[int],
        done: int,
        total: int,
        on_progress: Callable[[int, int], None] | None,
        should_stop: Callable[[], bool] | None = None,
    ) -> bool:
        """Run the model over the tokens not yet cached (all but the last one).

        Returns True when stopped between chunks (every rank agrees, as in decode).
        """
        if on_progress:
            on_progress(done, total)
        return prefill(
            self.model,
            cache,
            tokens,
            before_chunk=lambda _: self._agreed_stop(should_stop),
            after_chunk=(lambda n: on_progress(done + n, total)) if on_progress else None,
        )

    def _agreed_stop(self, should_stop: Callable[[], bool] | None) -> bool:
        """Whether to stop now, the same answer on every rank (one collective when several).

        Every rank must call this at the same points, whether or not it has a stop source.
        """
        stop = should_stop() if should_stop is not None else False
        return self.group.any(stop) if self.group.size > 1 else stop

    def _decode(
        self,
        last: list[int],
        cache: list[Any],
        request: TurnRequest,
        start: float,
        on_text: Callable[[str], None] | None,
        should_stop: Callable[[], bool] | None,
    ) -> tuple[list[int], str, str, float, float]:
        def stop(generated: int) -> bool:
            # Across ranks the check is a collective: every few tokens, at the same
            # tokens on every rank, so a Ctrl-C still lands within a few tokens.
            check = self.group.size == 1 or generated % STOP_CHECK_EVERY == 0
            return check and self._agreed_stop(should_stop)

        return decode(
            self.model,
            self.tokenizer,
            last,
            cache,
            request.max_tokens,
            start,
            temp=request.temp,
            on_text=on_text,
            stop=stop,
        )

    def _new_cache(self) -> list[Any]:
        return make_prompt_cache(self.model, max_kv_size=self.options.max_kv_size)

    def _measure_bytes_per_token(self) -> int:
        """Bytes one token adds to this rank's cache, from one real forward pass.

        Run on every rank alike (a pipeline forward is itself collective).
        """
        cache = make_prompt_cache(self.model)
        self.model(mx.array([[0]]), cache=cache)
        mx.eval([c.state for c in cache])
        # Buffers are (batch, heads, capacity, dim): bytes per unit of capacity.
        buffers = [a for c in cache for a in _leaves(c.keys) + _leaves(c.values)]
        return int(sum(a.nbytes // max(a.shape[2], 1) for a in buffers))

    # -- reporting --------------------------------------------------------------

    def entries(self, per_rank_bpt: Sequence[float]) -> list[EntryInfo]:
        me = self.group.rank
        out = []
        for node in self.cache.tree.nodes():
            local = self.cache.entry_bytes(node)
            if self.cache.mode == "slices":
                sizes = [int(len(node.key) * b) for b in per_rank_bpt]
            else:  # snapshot sizes elsewhere are estimated until the next gather
                sizes = [int(local * b / max(per_rank_bpt[me], 1)) for b in per_rank_bpt]
            sizes[me] = local
            out.append(
                EntryInfo(
                    id=node.id,
                    parent=node.parent.id if node.parent and node.parent.parent else None,
                    session=node.session,
                    tokens=len(node.key),
                    depth=node.depth,
                    bytes=sizes,
                    hits=node.hits,
                    last_used=node.last_used,
                )
            )
        return out

    def _event(
        self, kind: str, node: Node, per_rank_bpt: Sequence[float], session: str, hit: int = 0
    ) -> CacheEvent:
        return CacheEvent(
            kind=kind,
            decision=self.decision,
            entry=node.id,
            tokens=len(node.key),
            bytes=[int(len(node.key) * b) for b in per_rank_bpt],
            session=session,
            hit_length=hit,
        )


def prefill(
    model: Any,
    cache: list[Any],
    tokens: Sequence[int],
    before_chunk: Callable[[int], bool] | None = None,
    after_chunk: Callable[[int], None] | None = None,
) -> bool:
    """Run the model over `tokens` into `cache`, PREFILL_STEP at a time.

    before_chunk(tokens done) returning True stops it (returns True); after_chunk
    gets the tokens done so far. The engine and the bench share this code path.
    """
    for i in range(0, len(tokens), PREFILL_STEP):
        if before_chunk is not None and before_chunk(i):
            return True
        chunk = mx.array(tokens[i : i + PREFILL_STEP])[None]
        model(chunk, cache=cache)
        mx.eval([c.state for c in cache])
        if after_chunk is not None:
            after_chunk(i + chunk.shape[1])
    return False


def decode(
    model: Any,
    tokenizer: Any,
    last: list[int],
    cache: list[Any],
    max_tokens: int,
    start: float,
    temp: float = 0.0,
    on_text: Callable[[str], None] | None = None,
    stop: Callable[[int], bool] | None = None,
) -> tuple[list[int], str, str, float, float]:
    """Generate after `last` with mlx-lm's generate_step.

    Returns (token ids incl. an end-of-turn token, reply text, finish reason, TTFT
    measured from `start`, decode tokens/s). stop(tokens generated) is asked after
    each token. The engine and the bench share this code path.
    """
    detok = tokenizer.detokenizer
    detok.reset()
    streamed = 0  # characters of the reply passed to on_text
    eos = set(tokenizer.eos_token_ids)
    generated: list[int] = []
    ttft = 0.0
    first = last_time = time.perf_counter()
    finish = "length"
    steps = generate_step(
        mx.array(last),
        model,
        prompt_cache=cache,
        max_tokens=max_tokens,
        sampler=make_sampler(temp=temp),
    )
    for token, _ in steps:
        token = int(token)
        last_time = time.perf_counter()
        if not generated:
            ttft = last_time - start
            first = last_time
        generated.append(token)
        if token in eos:
            finish = "stop"
            break
        detok.add_token(token)
        if on_text:
            piece = detok.last_segment
            streamed += len(piece)
            on_text(piece)
        if stop is not None and stop(len(generated)):
            finish = "interrupted"
            break
        if len(generated) >= max_tokens:
            break
    detok.finalize()
    # Not last_segment: after finalize it can miss what text has (e.g. a U+FFFD for
    # a cut UTF-8 sequence), and what was streamed must be the reply.
    if on_text and len(detok.text) > streamed:
        on_text(detok.text[streamed:])
    tps = (len(generated) - 1) / (last_time - first) if len(generated) > 1 else 0.0
    return generated, detok.text, finish, ttft, tps


def _leaves(x: Any) -> list[mx.array]:
    return list(x) if isinstance(x, tuple | list) else [x]


def _flat_params(model: Any) -> list[tuple[str, mx.array]]:
    from mlx.utils import tree_flatten

    return tree_flatten(model.parameters())


def _tree_digest(nodes: Sequence[Node]) -> int:
    """A checksum of the tree's shape, compared across ranks in the same collective."""
    text = ";".join(f"{n.id}:{n.depth}:{n.parent.id if n.parent else -1}" for n in nodes)
    return zlib.crc32(text.encode())
