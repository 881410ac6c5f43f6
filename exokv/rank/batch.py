"""Several requests' turns decoded together, run identically on every rank.

For each request in the batch's order (chosen by the front end, the same on every
rank): render -> fetch its cached prefix (not lent: two rows may share a path) ->
the turn's one collective (`coord.begin`) -> prefill its new tokens alone. Then the
rows' caches are merged (mlx-lm's left-padded `BatchKVCache`) and decoded one step
at a time (one sampler call for the batch, the next step queued before Python
handles this one's tokens); a row ends at its end-of-turn token, its max_tokens
or an agreed stop (one gather of a bit per row each step), and its cache is taken
out once its last token has run (as `generate_step` runs every token it gives).
Then, at that step, in the batch's order: insert, cap — the one-at-a-time turn's
end — and the row's outcome goes out (`on_row`) while the other rows decode on.

Every decision is made from the rows' tokens and the gathered numbers, in the
batch's order, so the ranks' trees stay identical. Batching needs plain full
attention K/V in every layer; a quantized KV cache, a rotating window
(--max-kv-size, sliding layers) or state layers (hybrid models) run the rows one
at a time through `Engine.turn` instead (`batchable`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.generate import generation_stream
from mlx_lm.models.cache import BatchKVCache, KVCache
from mlx_lm.sample_utils import make_sampler

from exokv.cache import memory
from exokv.cache.prefix_cache import Hit
from exokv.errors import PromptTooLong
from exokv.rank.stops import TextStops
from exokv.rank.textflow import TextFlow
from exokv.records import CacheEvent, RowOutcome, TurnRequest, TurnResult
from exokv.wire.messages import Batch, Progress, Row

# Per-row callbacks: the row's index in the batch comes first.
RowText = Callable[[int, str], None]
RowProgress = Callable[[int, int, int], None]
RowStop = Callable[[int], bool]
RowEnd = Callable[[int, RowOutcome], None]


@dataclass
class _Row:
    index: int
    request: TurnRequest
    tokens: list[int]
    decision: int
    hit: Hit
    index_in_batch: int = 0  # its place among the decoded rows (its sampler)
    events: list[CacheEvent] = field(default_factory=list)
    generated: list[int] = field(default_factory=list)
    finish: str = "length"
    stopped_in_prefill: bool = False
    cache: list[Any] | None = None  # its own cache again, once its decode ended
    ttft: float = 0.0
    first: float = 0.0
    last: float = 0.0
    overhead: float = 0.0
    streamed: int = 0
    detok: Any = None
    stops: TextStops = field(default_factory=lambda: TextStops(()))


def batchable(engine: Any) -> bool:
    """Whether the engine's cache can be merged into a batch exactly: plain K/V in every
    layer (no quantized KV, no rotating window, no state) — the same on every rank, as
    every rank builds its cache from the same options and agreed storage classes."""
    return engine.cache.exact_anywhere and all(type(c) is KVCache for c in engine._new_cache())


def run_batch(
    engine: Any,
    requests: Sequence[TurnRequest],
    on_text: RowText | None = None,
    on_progress: RowProgress | None = None,
    should_stop: RowStop | None = None,
    on_step: Callable[[], None] | None = None,
    on_row: RowEnd | None = None,
) -> list[RowOutcome]:
    """Each request's turn, decoded together where the engine allows; outcomes in order.
    on_step() is called after each decode step's text (rank 0 sends the step's pieces
    as one message); on_row(row, outcome) as soon as a row has ended and its tokens
    are in the tree, so its caller need not wait for the batch's longest row.

    Every rank must call this with the same requests in the same order, and pass a
    `should_stop` (only rank 0's ever says yes: the stop is agreed by a collective).
    """

    def row_text(i: int) -> Callable[[str], None] | None:
        if on_text is None:
            return None

        def text(piece: str) -> None:
            on_text(i, piece)
            if on_step is not None:  # a row alone: each piece is its step's
                on_step()

        return text

    def row_progress(i: int) -> Callable[[int, int], None] | None:
        return (lambda d, t: on_progress(i, d, t)) if on_progress else None

    def row_stop(i: int) -> Callable[[], bool]:
        return lambda: bool(should_stop and should_stop(i))

    # A seeded sample is reproducible alone only; without the cache, a turn is its own.
    alone = any(not r.use_cache or (r.sample_seed is not None and r.temp > 0) for r in requests)
    if len(requests) == 1 or alone or not batchable(engine):
        outcomes = []
        for i, request in enumerate(requests):
            try:
                result = engine.turn(request, row_text(i), row_progress(i), row_stop(i))
            except PromptTooLong as err:  # every rank alike, before any collective
                outcomes.append(_refused(err))
            else:
                outcomes.append(RowOutcome(result=result))
            if on_row is not None:
                on_row(i, outcomes[-1])
        return outcomes
    return _Batch(engine, requests, on_text, on_progress, should_stop, on_step, on_row).run()


def _refused(err: PromptTooLong) -> RowOutcome:
    return RowOutcome(refused=str(err), tokens=err.tokens, context=err.context)


BatchSampler = Callable[[mx.array, list[_Row]], mx.array]


def _batch_sampler(requests: Sequence[TurnRequest]) -> BatchSampler:
    """The next token of each active row from its log-probabilities: one sampler call
    for the whole batch when every row samples alike (the common case, and the
    cheapest step), else one call per row with its own temperature and top_p."""
    settings = {(r.temp, r.top_p) for r in requests}
    if len(settings) == 1:
        shared = make_sampler(temp=requests[0].temp, top_p=requests[0].top_p)

        def together(logprobs: mx.array, active: list[_Row]) -> mx.array:
            with mx.stream(generation_stream):
                return shared(logprobs)

        return together
    samplers = [make_sampler(temp=r.temp, top_p=r.top_p) for r in requests]

    def each(logprobs: mx.array, active: list[_Row]) -> mx.array:
        with mx.stream(generation_stream):
            return mx.concatenate(
                [samplers[r.index_in_batch](logprobs[j : j + 1]) for j, r in enumerate(active)]
            )

    return each


class _Batch:
    def __init__(
        self,
        engine: Any,
        requests: Sequence[TurnRequest],
        on_text: RowText | None,
        on_progress: RowProgress | None,
        should_stop: RowStop | None,
        on_step: Callable[[], None] | None = None,
        on_row: RowEnd | None = None,
    ) -> None:
        self.engine = engine
        self.on_step = on_step
        self.on_row = on_row
        self.rows = 1  # rows decoded together (the access log's batch=)
        self.requests = list(requests)
        self.on_text = on_text
        self.on_progress = on_progress
        self.should_stop = should_stop
        self.outcomes: list[RowOutcome] = [RowOutcome() for _ in requests]
        self.start = time.perf_counter()

    def run(self) -> list[RowOutcome]:
        rows: list[_Row] = []
        for i, request in enumerate(self.requests):
            row = self._begin(i, request)
            if row is not None:
                rows.append(row)
            elif self.on_row is not None:  # refused: its answer need not wait
                self.on_row(i, self.outcomes[i])
        decoding = [r for r in rows if not r.stopped_in_prefill]
        self.rows = max(len(decoding), 1)
        for row in rows:
            if row.stopped_in_prefill:  # its client left before its first token
                self._finish(row)
        for k, row in enumerate(decoding):
            row.index_in_batch = k
        if decoding:
            self._decode(decoding)
        return self.outcomes

    def _finish(self, row: _Row) -> None:
        """A row that ended: its insert and cap now, at the same step on every rank (the
        rows end where their tokens and the agreed stops say), and its outcome out."""
        self.outcomes[row.index] = RowOutcome(result=self._end(row), batch=self.rows)
        if self.on_row is not None:
            self.on_row(row.index, self.outcomes[row.index])

    # -- before decode: each row alone, in the batch's order -----------------------

    def _begin(self, i: int, request: TurnRequest) -> _Row | None:
        """Render, fetch, the one collective and prefill, as `Engine.turn` does them."""
        engine = self.engine
        tic = time.perf_counter()
        tokens = engine.render(request.messages)
        if engine.context is not None and len(tokens) > engine.context:
            self.outcomes[i] = RowOutcome(
                refused=f"the prompt is {len(tokens):,} tokens and the model's context is "
                f"{engine.context:,}: not run",
                tokens=len(tokens),
                context=engine.context,
            )
            return None
        engine.decision += 1
        expect = len(tokens) + request.max_tokens
        hit = engine.cache.fetch(tokens, expect=expect, lend=False)
        row = _Row(i, request, tokens, engine.decision, hit)
        coord = engine.coord
        if coord.tier is not None:
            row.events += coord.tier.take_events(row.decision)
        if hit.entry is not None:
            row.events.append(
                coord.event("hit", hit.entry, request.session, row.decision, hit.length)
            )
        meets = engine.cache.tree.match(tokens).length
        room = -(-expect // KVCache.step) * KVCache.step - expect
        new_tokens = len(tokens) - meets + request.max_tokens + room
        probe = memory.sample(engine.group.rank)
        try:
            coord.begin(row.decision, new_tokens, probe, row.events, copied=hit.length)
            row.overhead = time.perf_counter() - tic
            progress = (
                (lambda d, t: self.on_progress(i, d, t)) if self.on_progress is not None else None
            )
            row.stopped_in_prefill = engine._prefill(
                hit.cache,
                tokens[hit.length : len(tokens) - 1],
                hit.length,
                len(tokens),
                progress,
                lambda: self._asked(i),
            )
        finally:
            # The row's cache is its own copy (nothing was lent): its path is unlocked
            # now, so any row's cap may evict what the others fetched (a batch is never
            # held over budget by its own rows), and a row's end need not wait for them.
            engine.cache.release(hit)
        if row.stopped_in_prefill:
            row.finish = "interrupted"
            row.cache = hit.cache
        return row

    def _asked(self, i: int) -> bool:
        return bool(self.should_stop is not None and self.should_stop(i))

    # -- decode: the rows together --------------------------------------------------

    def _decode(self, rows: list[_Row]) -> None:
        engine = self.engine
        for row in rows:
            row.detok = engine.tokenizer.detokenizer  # a fresh copy per row
            row.detok.reset()
            row.stops = TextStops(engine.stops)
        sample = _batch_sampler([r.request for r in rows])
        with mx.stream(generation_stream):
            n_layers = len(rows[0].hit.cache)
            batch = [BatchKVCache.merge([r.hit.cache[k] for r in rows]) for k in range(n_layers)]
        for r in rows:
            r.hit.cache = None  # merged: the row's own copy is no longer needed
        active = list(rows)  # the rows in `batch`, in its order
        picked = sample(self._step(batch, mx.array([r.tokens[-1] for r in active])), active)
        mx.async_eval(picked)
        while True:
            # The next step is queued before Python handles this one's tokens (as
            # generate_step does), so the model runs meanwhile. Every rank queues it
            # before its stop gather, on the same stream: the collectives keep one order.
            # Running a row's token before its stop is known is what the row's end
            # needs anyway: its cache, taken out below, holds every token it was given.
            following = sample(self._step(batch, picked), active)
            mx.async_eval(following)
            tokens = picked.tolist()
            now = time.perf_counter()
            for r, token in zip(active, tokens, strict=True):
                self._take(r, token, now)
            if self.on_step is not None:
                self.on_step()
            for r, stop in zip(active, self._agreed_stops(active), strict=True):
                if stop and r.finish == "length":
                    r.finish = "interrupted"
            picked = following
            ending = [j for j, r in enumerate(active) if self._ended(r)]
            if not ending:
                continue
            for j in ending:
                row = active[j]
                row.cache = [c.extract(j) for c in batch]
                mx.eval([c.keys for c in row.cache])
                self._flush(row)
            if self.on_step is not None:
                self.on_step()
            for j in ending:  # in the batch's order, on every rank
                self._finish(active[j])
            keep = [j for j in range(len(active)) if j not in ending]
            if not keep:
                return
            for c in batch:
                c.filter(mx.array(keep))
            active = [active[j] for j in keep]
            picked = picked[mx.array(keep)]  # the ended rows' next tokens are dropped

    def _step(self, batch: list[Any], tokens: mx.array) -> mx.array:
        """One token per row run (queued, not evaluated); each row's log-probabilities of
        the next (as generate_step)."""
        with mx.stream(generation_stream):
            logits = self.engine.model(tokens[:, None], cache=batch)[:, -1, :]
            return logits - mx.logsumexp(logits, axis=-1, keepdims=True)

    def _take(self, r: _Row, token: int, now: float) -> None:
        if not r.generated:
            r.ttft = now - self.start
            r.first = now
        r.last = now
        r.generated.append(token)
        if token in self.engine._eos:
            r.finish = "stop"
            return
        r.detok.add_token(token)
        if r.stops:
            if r.stops.feed(r.detok.text):
                r.finish = "stop"
                return
            shown = r.stops.safe(r.detok.text)
            if shown > r.streamed and self.on_text is not None:
                self.on_text(r.index, r.detok.text[r.streamed : shown])
                r.streamed = shown
            return
        piece = r.detok.last_segment
        if piece and self.on_text is not None:
            r.streamed += len(piece)
            self.on_text(r.index, piece)

    def _ended(self, r: _Row) -> bool:
        return r.finish != "length" or len(r.generated) >= r.request.max_tokens

    def _agreed_stops(self, active: list[_Row]) -> list[bool]:
        """Which rows the front end stopped, the same answer on every rank: one gather of
        a bit per row (every rank calls it at every step, whatever it has to say)."""
        local = [int(self._asked(r.index)) for r in active]
        group = self.engine.group
        if group.size == 1:
            return [bool(b) for b in local]
        rows = group.gather(local)
        return [any(row[j] for row in rows) for j in range(len(active))]

    def _flush(self, r: _Row) -> None:
        r.detok.finalize()
        reply = r.stops.reply(r.detok.text)
        if self.on_text is not None and len(reply) > r.streamed:
            self.on_text(r.index, reply[r.streamed :])

    # -- after decode: each row's insert and cap, in the batch's order --------------

    def _end(self, row: _Row) -> TurnResult:
        engine = self.engine
        tic = time.perf_counter()
        reply = row.stops.reply(row.detok.text) if row.detok is not None else ""
        engine._remember_reply(reply, row.stops.kept(row.generated))
        cache = row.cache if row.cache is not None else []
        ran = len(row.tokens) + len(row.generated)
        if row.stopped_in_prefill:
            from exokv.cache import kinds

            ran = kinds.offset(cache) or row.hit.length
        full = row.tokens + row.generated
        if ran > 0 and cache:
            added, changed = engine.cache.insert(full, cache, row.request.session, length=ran)
            coord = engine.coord
            session = row.request.session
            row.events += [coord.event("update", n, session, row.decision) for n in changed]
            row.events += [coord.event("add", n, session, row.decision) for n in added]
        row.cache = None
        live = engine.cache.tree.match(full[:ran]).path
        engine.coord.cap(row.decision, live, ran, row.request.session, row.events)
        if engine.coord.tier is not None:
            row.events += engine.coord.tier.take_events(row.decision)
        stats, entries = engine.coord.stats(), engine.coord.changed_entries()
        n = len(row.generated)
        tps = (n - 1) / (row.last - row.first) if n > 1 and row.last > row.first else 0.0
        return TurnResult(
            session=row.request.session,
            reply=reply,
            prompt_tokens=len(row.tokens),
            cached_tokens=row.hit.length,
            prefilled_tokens=len(row.tokens) - row.hit.length,
            generated_tokens=n,
            ttft_s=row.ttft,
            decode_tps=tps,
            overhead_s=row.overhead + time.perf_counter() - tic,
            ranks=engine.group.size,
            finish_reason=row.finish,
            decision=row.decision,
            events=row.events,
            rank_stats=stats,
            entries=entries,
        )


def answer_batch(
    engine: Any, message: Batch, link: Any, stopped: set[Any], flow: TextFlow | None
) -> None:
    """A `batch` message from the front end, run on this rank (every rank alike); rank 0
    (the one with a `link`, and a `flow` for the text) streams each row's text under the
    row's id, and each row's result as soon as the row ends. `stopped` holds the ids of
    rows the front end asked to stop (rank 0's only)."""
    ids = [row.id for row in message.rows]
    requests = [row.request for row in message.rows]

    def on_text(i: int, piece: str) -> None:
        flow.add(ids[i], piece)

    def on_step() -> None:
        flow.step()

    def on_progress(i: int, done: int, total: int) -> None:
        link.send(Progress(ids[i], done, total))

    def on_row(i: int, outcome: RowOutcome) -> None:
        flow.flush()  # the row's last text comes before its result
        result = outcome.result
        tokens = engine.reply_tokens(result.reply) if result is not None else None
        link.send(Row(ids[i], outcome, tokens))

    try:
        run_batch(
            engine,
            requests,
            on_text=on_text if flow is not None else None,
            on_progress=on_progress if link is not None else None,
            # Every rank passes one (never true off rank 0): the stop is a collective.
            should_stop=lambda i: ids[i] in stopped,
            on_step=on_step if flow is not None else None,
            on_row=on_row if flow is not None else None,
        )
    finally:
        stopped.difference_update(ids)
