"""Several requests' turns decoded together, run identically on every rank.

For each request in the batch's order (chosen by the front end, the same on every
rank): render -> fetch its cached prefix (not lent: two rows may share a path) ->
the turn's one collective (`coord.begin`) -> prefill its new tokens alone. Then the
rows' caches are merged (mlx-lm's left-padded `BatchKVCache`) and decoded one step
at a time (one sampler call for the batch, the next step queued before Python
handles this one's tokens); a row ends at its end-of-turn token, its max_tokens
or an agreed stop (one gather of a bit per row each step), and its cache is taken
out once its last token has run (as `generate_step` runs every token it gives); its
slot stays vacant for a newcomer a few steps (exokv.rank.slots) rather than the batch
being copied without it.
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

from exokv.cache import kinds, memory
from exokv.cache.prefix_cache import Hit
from exokv.core.records import CacheEvent, RowOutcome, TurnRequest, TurnResult
from exokv.errors import PromptTooLong
from exokv.rank import batch_drafts, constrain, slots
from exokv.rank.engine import cache_room, prefill, within_context
from exokv.rank.joinfill import prefill_together, waits_for, widths
from exokv.rank.joins import JoinBox
from exokv.rank.pace import Pace
from exokv.rank.stops import TextStops
from exokv.rank.textflow import TextFlow
from exokv.wire.messages import Batch, Progress, Row

# Per-row callbacks: the row's index in the batch comes first.
RowText = Callable[[int, str], None]
RowProgress = Callable[[int, int, int], None]
RowStop = Callable[[int], bool]
RowEnd = Callable[[int, RowOutcome], None]
# Rank 0's requests that join the batch now (the front end's choice and order).
Joins = Callable[[], list[TurnRequest]]

# A joining row's prefill runs in chunks of about this much time, one chunk per decode
# step: what a decoding row waits for a newcomer at a step, however long its prompt.
# When a decode step of the batch takes longer, a chunk may take as long as the step:
# a decoding row then waits at most one step more, and newcomers behind many rows are
# not admitted a sliver at a time (64 rows on two cores: ~0.6 s a step).
JOIN_CHUNK_S = 0.1


@dataclass
class _Row:
    index: int
    request: TurnRequest
    tokens: list[int]
    decision: int
    hit: Hit
    start: float = 0.0  # when it was admitted (its time to first token counts from here)
    done: int = 0  # its prompt's tokens in its cache so far
    peak: int = 0  # the most rows decoded together while it decoded
    fed_prompt: bool = False  # its last prompt token has run (its tokens since are its reply)
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
    constraint: constrain.Constraint | None = None  # its request's grammar, if any
    # With its request's logprobs: each sampled token's (lazy) report, first sampled
    # first, taken with its token; and the reports of the tokens taken.
    sampled: list[tuple[mx.array, mx.array, mx.array]] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)
    drafter: batch_drafts.RowDrafter | None = None  # its drafts, if it speculates


def _vacancy() -> _Row:
    """The placeholder of a vacant slot in `_Batch.active` (never read as a row)."""
    return _Row(-1, TurnRequest(session="", messages=[], max_tokens=0), [], 0, None)  # type: ignore[arg-type]


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
    joins: Joins | None = None,
    joinable: bool | None = None,
) -> list[RowOutcome]:
    """Each request's turn, decoded together where the engine allows; outcomes in order.
    on_step() is called after each decode step's text (rank 0 sends the step's pieces
    as one message); on_row(row, outcome) as soon as a row has ended and its tokens
    are in the tree, so its caller need not wait for the batch's longest row.

    With `joinable` (every rank alike; by default, whether `joins` is given), rank 0's
    `joins()` is asked at every decode step for requests that join the batch: each is
    admitted at that step on every rank (rank 0 broadcasts it), prefilled a chunk per
    step while the others decode, then decoded with them; its outcome comes at
    on_row(i, ...) with i its place after the rows before it. A lone request then runs
    as a batch of one, so that others can join it.

    Every rank must call this with the same requests in the same order, and pass a
    `should_stop` (only rank 0's ever says yes: the stop is agreed by a collective).
    """
    joinable = joins is not None if joinable is None else joinable
    # A seeded sample is reproducible alone only; without the cache, a turn is its own.
    alone = any(not r.use_cache or (r.sample_seed is not None and r.temp > 0) for r in requests)
    if (len(requests) == 1 and not joinable) or alone or not batchable(engine):
        return _one_at_a_time(engine, requests, on_text, on_progress, should_stop, on_step, on_row)
    return _Batch(
        engine, requests, on_text, on_progress, should_stop, on_step, on_row, joins, joinable
    ).run()


def _one_at_a_time(
    engine: Any,
    requests: Sequence[TurnRequest],
    on_text: RowText | None,
    on_progress: RowProgress | None,
    should_stop: RowStop | None,
    on_step: Callable[[], None] | None,
    on_row: RowEnd | None,
) -> list[RowOutcome]:
    """Each request through `Engine.turn` in order, with the row callbacks as a turn's."""

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


def join_pace(engine: Any) -> Pace:
    """The engine's pace for joining rows' prefill chunks (rank 0's decides the sizes),
    kept across batches: the rate measured in one sizes the next one's first chunk."""
    pace = getattr(engine, "join_pace", None)
    if pace is None:
        pace = Pace(target_s=JOIN_CHUNK_S)
        engine.join_pace = pace
    return pace


def _refused(err: PromptTooLong) -> RowOutcome:
    return RowOutcome(refused=str(err), tokens=err.tokens, context=err.context)


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
        joins: Joins | None = None,
        joinable: bool = False,
    ) -> None:
        self.engine = engine
        self.on_step = on_step
        self.on_row = on_row
        self.requests = list(requests)
        self.on_text = on_text
        self.on_progress = on_progress
        self.should_stop = should_stop
        self.joins = joins  # rank 0's source of joining requests (None elsewhere)
        self.joinable = joinable  # every rank alike: whether the steps carry joins
        self.outcomes: list[RowOutcome] = [RowOutcome() for _ in requests]
        self.pace = join_pace(engine)
        self.step_s = 0.0  # this rank's last decode step, without its prefill chunk
        self.chunk_s = 0.0  # this rank's last prefill pass
        self.samplers: dict[tuple[float, float], Callable[[mx.array], mx.array]] = {}
        self.pending: list[_Row] = []  # admitted rows still prefilling, first come first
        self.starting: list[_Row] = []  # the first rows still prefilling
        self.ready: list[_Row] = []  # rows prefilled, waiting for the first rows' start
        self.active: list[_Row] = []  # the rows in `batch`, in its order
        self.batch: list[Any] | None = None  # the decoding rows' merged caches, per layer
        # Slots of `batch` whose row ended, each with the step it did; `active` holds a
        # placeholder there until a newcomer takes it (exokv.rank.slots).
        self.vacant: dict[int, int] = {}
        self.steps = 0  # decode steps so far

    def run(self) -> list[RowOutcome]:
        for i, request in enumerate(self.requests):
            self._admit(i, request)
        # The first rows start decoding together, once all are prefilled (as the batch
        # they came in); a row that joins later starts as soon as its own prefill ends.
        self.starting = [r for r in self.pending]
        self._loop()
        return self.outcomes

    def _finish(self, row: _Row) -> None:
        """A row that ended: its insert and cap now, at the same step on every rank (the
        rows end where their tokens and the agreed stops say), and its outcome out."""
        self.outcomes[row.index] = RowOutcome(result=self._end(row), batch=max(row.peak, 1))
        if self.on_row is not None:
            self.on_row(row.index, self.outcomes[row.index])

    # -- a row comes in: render, fetch, the one collective -------------------------

    def _admit(self, i: int, request: TurnRequest) -> None:
        """Render (a prompt over the context is refused here); its fetch and the turn's
        one collective come when its prefill starts (`_begin`), so it is served what
        the rows before it stored meanwhile (a shared system prompt)."""
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
            if self.on_row is not None:  # refused: its answer need not wait
                self.on_row(i, self.outcomes[i])
            return
        request = within_context(request, len(tokens), engine.context)
        row = _Row(i, request, tokens, 0, None, start=tic)  # type: ignore[arg-type]
        row.overhead = time.perf_counter() - tic
        self.pending.append(row)

    def _begin(self, row: _Row) -> None:
        """Fetch and the turn's one collective, as `Engine.turn` does them."""
        engine, request, tokens = self.engine, row.request, row.tokens
        tic = time.perf_counter()
        engine.decision += 1
        row.decision = engine.decision
        expect = len(tokens) + request.max_tokens
        hit = engine.cache.fetch(tokens, expect=expect, lend=False)
        row.hit, row.done = hit, hit.length
        coord = engine.coord
        row.events += coord.tier_events(row.decision)
        if hit.entry is not None:
            row.events.append(
                coord.event("hit", hit.entry, request.session, row.decision, hit.length)
            )
        meets = engine.cache.held(tokens)
        new_tokens = len(tokens) - meets + request.max_tokens + cache_room(expect)
        probe = memory.sample(engine.group.rank)
        coord.begin(row.decision, new_tokens, probe, row.events, copied=hit.length)
        # Its cache is its own copy (nothing was lent): its path is unlocked now, so the
        # cap of a row that ends while this one prefills may evict what it fetched (a
        # batch is never held over budget by its own rows).
        engine.cache.release(hit)
        row.overhead += time.perf_counter() - tic
        if self.on_progress is not None:
            self.on_progress(row.index, row.done, len(tokens))

    def _asked(self, i: int) -> bool:
        return bool(self.should_stop is not None and self.should_stop(i))

    # -- the steps: decode the active rows, admit joins, prefill a chunk --------------

    def _loop(self) -> None:
        picked: mx.array | None = None  # the active rows' next tokens (queued)
        taken = 0  # the first rows of `picked` whose tokens were already handled
        while self.active or self.pending or self.ready:
            following, tic, self.chunk_s = None, time.perf_counter(), 0.0
            if self.active and batch_drafts.wanted(self):
                # A step with rows' drafts: it waits for this step's tokens, which
                # it takes itself (exokv.rank.batch_drafts).
                following = batch_drafts.step(self, picked, taken)
            elif self.active:
                # The next step is queued before Python handles this one's tokens (as
                # generate_step does), so the model runs meanwhile. Every rank queues it
                # before its step's gather, on the same stream: the collectives keep one
                # order. Running a row's token before its stop is known is what the
                # row's end needs anyway: its cache, taken out below, holds every token
                # it was given.
                assert picked is not None and self.batch is not None
                following = self._sample(self._step(self.batch, picked), self.active, picked)
                mx.async_eval(following)
                self.take_step(picked.tolist(), taken)
            taken = 0
            if self.on_step is not None:
                self.on_step()
            stops, stopped, joined, size = self._agree()
            for j, (r, stop) in enumerate(zip(self.active, stops, strict=True)):
                if stop and r.finish == "length" and j not in self.vacant:
                    r.finish = "interrupted"
            picked = following
            picked = self._end_rows(picked)
            for r, stop in zip(list(self.pending), stopped, strict=True):
                if stop:  # its client left before its first token
                    self._stop_in_prefill(r)
            for request in joined:  # at this step, in rank 0's order, on every rank
                self.requests.append(request)
                self.outcomes.append(RowOutcome())
                self._admit(len(self.requests) - 1, request)
            ready: list[_Row] = []
            if self.pending:
                if picked is not None:
                    # The step is computed before the chunk runs: its tokens go out now,
                    # not a chunk later (a newcomer's first token among them). Every rank
                    # handles them here alike; the next step still runs them, as a
                    # row's end needs.
                    taken = self._take_now(picked)
                ready = self._prefill_chunks(size)
            self.step_s = time.perf_counter() - tic - self.chunk_s if self.active else 0.0
            self.starting = [r for r in self.starting if r in self.pending]
            if self.starting:
                self.ready += ready
                continue
            ready, self.ready = self.ready + ready, []
            if ready:
                picked = self._merge(ready, picked)
            picked = self._compact(picked)

    def _agree(self) -> tuple[list[bool], list[bool], list[TurnRequest], int]:
        """This step's decisions, rank 0's on every rank: which active and which
        prefilling rows the front end stopped, the requests that join now and the size
        of the prefill chunk. One gather (when several ranks), and a broadcast of the
        joining requests only at a step that has some."""
        local = [
            int(j not in self.vacant and self._asked(r.index)) for j, r in enumerate(self.active)
        ]
        local += [int(self._asked(r.index)) for r in self.pending]
        joined = self.joins() if self.joins is not None and self.joinable else []
        self.pace.target_s = max(JOIN_CHUNK_S, self.step_s)  # rank 0's decides
        chunk = self.pace.tokens()
        group = self.engine.group
        n = len(local)
        switch = batch_drafts.for_engine(self.engine)  # rank 0's: drafting on or off
        drafts = switch.wanted() if group.rank == 0 else 0
        if group.size > 1:
            rows = group.gather(local + [len(joined), chunk if group.rank == 0 else 0, drafts])
            bits = [any(row[j] for row in rows) for j in range(n)]
            count, chunk, drafts = rows[0][n], rows[0][n + 1], rows[0][n + 2]
            if count:
                sent = group.broadcast([r.to_dict() for r in joined] if group.rank == 0 else None)
                joined = [TurnRequest.from_dict(r) for r in sent]
        else:
            bits = [bool(b) for b in local]
        switch.on = bool(drafts)
        k = len(self.active)
        return bits[:k], bits[k:], joined, chunk

    def _end_rows(self, picked: mx.array | None) -> mx.array | None:
        """The rows that ended at this step leave the batch: each one's cache taken out
        whole, then its insert and cap, in the batch's order; its slot is left vacant
        for a newcomer (the token the queued step sampled for it runs there unread).
        Returns the batch's next tokens."""
        active = self.active
        ending = [j for j, r in enumerate(active) if j not in self.vacant and self._ended(r)]
        if not ending:
            return picked
        assert self.batch is not None
        for j in ending:
            row = active[j]
            row.cache = [c.extract(j) for c in self.batch]
            mx.eval([c.keys for c in row.cache])
            self._flush(row)
        if self.on_step is not None:
            self.on_step()
        for j in ending:  # in the batch's order, on every rank
            self._finish(active[j])
            self.vacant[j] = self.steps
            active[j] = _vacancy()
        if not self._live():
            self.active, self.batch, self.vacant = [], None, {}
            return None
        return picked

    def take_step(self, tokens: list[int], taken: int) -> None:
        """A decode step's tokens: each live row takes its own, but for the first
        `taken` rows' (handled before the last step's prefill chunk) and a row's last
        prompt token (run in this step: not a reply's). Counts the step."""
        self.steps += 1
        now, live = time.perf_counter(), self._live()
        for j, (r, token) in enumerate(zip(self.active, tokens, strict=True)):
            if j in self.vacant:
                continue
            r.peak = max(r.peak, live)
            if j < taken and r.fed_prompt:
                # (A newcomer put in a vacant slot since has not run its prompt's last
                # token: its slot's token is its own.)
                continue
            if r.fed_prompt:
                self._take(r, token, now)
            else:
                r.fed_prompt = True

    def _live(self) -> int:
        return len(self.active) - len(self.vacant)

    def _compact(self, picked: mx.array | None) -> mx.array | None:
        """The vacancies no newcomer took in time leave the batch, in one filter (which
        also trims the left padding no live row uses): exokv.rank.slots decides when."""
        if self.batch is None or picked is None:
            return picked
        longest = max(
            len(r.tokens) + len(r.generated) + 2
            for j, r in enumerate(self.active)
            if j not in self.vacant
        )
        length = self.batch[0]._idx
        if not slots.compact_now(self.vacant, self.steps, self._live(), length, longest):
            return picked
        keep = slots.keep(self.vacant, len(self.active))
        self.active = [r for j, r in enumerate(self.active) if j not in self.vacant]
        self.vacant = {}
        with mx.stream(generation_stream):
            for c in self.batch:
                c.filter(keep)
            return picked[keep]

    def _take_now(self, picked: mx.array) -> int:
        """The active rows' tokens of the step just queued, handled at once; how many."""
        tokens = picked.tolist()
        now = time.perf_counter()
        for j, (r, token) in enumerate(zip(self.active, tokens, strict=True)):
            if j not in self.vacant:
                self._take(r, token, now)
        if self.on_step is not None:
            self.on_step()
        return len(tokens)

    def _stop_in_prefill(self, row: _Row) -> None:
        if row.hit is None:  # stopped before its fetch: it begins and ends at once
            self._begin(row)
        self.pending.remove(row)
        row.stopped_in_prefill = True
        row.finish = "interrupted"
        row.cache = row.hit.cache
        self._finish(row)

    def _prefill_chunks(self, size: int) -> list[_Row]:
        """One chunk of `size` tokens (rank 0's pace) of the prefilling rows' prompts, the
        first come first, several rows' slices in one pass (exokv.rank.joinfill): how
        long the active rows wait at this step. Returns the rows whose prefill is done,
        in order."""
        engine = self.engine
        size, ready = max(1, size), []
        going: list[_Row] = []  # the rows prefilling at this step, first come first
        for row in list(self.pending):
            if len(going) >= size:
                break
            if row.hit is None:
                started = [r.tokens for r in self.pending if r.hit is not None]
                if waits_for(row.tokens, engine.cache.held(row.tokens), started):
                    continue  # it fetches what an earlier row stores, once stored
                self._begin(row)
            if row.done >= len(row.tokens) - 1:  # the tree held all of it
                ready.append(self._prefilled(row))
            else:
                going.append(row)
        sizes = widths([len(r.tokens) - 1 - r.done for r in going], size)
        going = going[: len(sizes)]
        tic = time.perf_counter()  # the pass alone: the rate it gives sizes the next one
        with mx.stream(generation_stream):
            if len(going) == 1:
                row = going[0]
                prefill(engine.model, row.hit.cache, row.tokens[row.done : row.done + sizes[0]])
            elif going:
                caches = [r.hit.cache for r in going]
                slices = [r.tokens[r.done : r.done + n] for r, n in zip(going, sizes, strict=True)]
                done = prefill_together(engine.model, caches, slices)
                for r, cache in zip(going, done, strict=True):
                    r.hit.cache = cache
        self.chunk_s = time.perf_counter() - tic
        for row, n in zip(going, sizes, strict=True):
            row.done += n
            if self.on_progress is not None:
                self.on_progress(row.index, row.done, len(row.tokens))
            if row.done >= len(row.tokens) - 1:
                ready.append(self._prefilled(row))
        if going:
            self.pace.took(len(going) * max(sizes), self.chunk_s)
        return ready

    def _prefilled(self, row: _Row) -> _Row:
        self.pending.remove(row)
        self._store_prompt(row)
        return row

    def _store_prompt(self, row: _Row) -> None:
        """A prefilled prompt goes into the tree now, not only with its reply at its end:
        a request that arrives meanwhile with the same system prompt (or any shared
        prefix) fetches it instead of prefilling it again. Then the cap, as after any
        insert, so the budget holds after this step too."""
        engine, n = self.engine, row.done
        if n <= row.hit.length:
            return  # nothing new: the tree held it all
        session, coord = row.request.session, engine.coord
        coord.store(row.tokens, row.hit.cache, n, session, row.decision, row.events)
        coord.cap(row.decision, engine.cache.path(row.tokens[:n]), n, session, row.events)

    def _merge(self, rows: list[_Row], picked: mx.array | None) -> mx.array:
        """Rows whose prefill is done join the decoding rows, in order: each into a vacant
        slot its cache fits (exokv.rank.slots), the others' caches into the batch (left
        padded) in one extend, not one each (an extend copies the whole batch); their
        last prompt tokens into the next step's tokens."""
        caches, placed, appended = [], [], []
        free = sorted(self.vacant)  # a newcomer takes the first vacancy its cache fits
        for row in rows:
            row.detok = self.engine.tokenizer.detokenizer  # a fresh copy per row
            row.detok.reset()
            row.stops = TextStops(self.engine.stops)
            row.constraint = constrain.for_request(self.engine, row.request.grammar)
            row.drafter = batch_drafts.drafter_for(row.tokens, row.request)
            if free and self.batch is not None and slots.fits(self.batch, row.hit.cache):
                placed.append((free.pop(0), row))
            else:
                caches.append(row.hit.cache)
                appended.append(row)
        with mx.stream(generation_stream):
            for slot, row in placed:
                slots.place(self.batch, slot, row.hit.cache)
                del self.vacant[slot]
                self.active[slot] = row
                assert picked is not None  # the slot's token now its prompt's last
                picked = mx.where(mx.arange(picked.shape[0]) == slot, row.tokens[-1], picked)
            if appended:
                own = [BatchKVCache.merge(list(layer)) for layer in zip(*caches, strict=True)]
                if self.batch is None:
                    self.batch = own
                else:
                    for c, mine in zip(self.batch, own, strict=True):
                        c.extend(mine)
                last = mx.array([row.tokens[-1] for row in appended])
                picked = last if picked is None else mx.concatenate([picked, last])
        for row in rows:
            row.hit.cache = None  # merged: the row's own copy is no longer needed
        self.active += appended
        return picked

    def _sample(self, logprobs: mx.array, active: list[_Row], picked: mx.array) -> mx.array:
        """The next token of each active row: one sampler call for the whole batch when
        every row samples alike (the common case, and the cheapest step), else one call
        per row with its own temperature and top_p. Rows with a grammar sample within
        its mask (`_constrained`); rows that asked for logprobs keep their report."""
        # A vacant slot samples as the first live row does: it never splits the call.
        settings = [(r.request.temp, r.request.top_p) for r in active]
        live = [s for j, s in enumerate(settings) if j not in self.vacant]
        settings = [live[0] if j in self.vacant else s for j, s in enumerate(settings)]
        for s in set(settings) - self.samplers.keys():
            self.samplers[s] = make_sampler(temp=s[0], top_p=s[1])
        with mx.stream(generation_stream):
            if any(r.constraint is not None for r in active):
                logprobs = self._constrained(logprobs, active, picked)
            if len(set(settings)) == 1:
                tokens = self.samplers[settings[0]](logprobs)
            else:
                tokens = mx.concatenate(
                    [self.samplers[s](logprobs[j : j + 1]) for j, s in enumerate(settings)]
                )
            for j, r in enumerate(active):
                k = r.request.logprobs
                if k is not None:  # lazy: read when the token is taken (`_take`)
                    r.sampled.append(constrain.top_arrays(logprobs[j], tokens[j], k))
            return tokens

    def _constrained(self, logprobs: mx.array, active: list[_Row], picked: mx.array) -> mx.array:
        """The step's log-probabilities with each constrained row's grammar applied.
        A row's grammar first takes the token it was given at this step (the one it
        sampled last), so this waits for the step before: a batch with a constrained
        row decodes without queueing its next step ahead."""
        given = picked.tolist()
        allowed = []
        for j, r in enumerate(active):
            if r.constraint is not None and r.fed_prompt:  # else: its prompt's last token
                r.constraint.advance(given[j])
            allowed.append(r.constraint.allowed() if r.constraint is not None else None)
        return constrain.normalized(constrain.masked(logprobs, allowed))

    def _step(self, batch: list[Any], tokens: mx.array) -> mx.array:
        """One token per row run (queued, not evaluated); each row's log-probabilities of
        the next (as generate_step)."""
        with mx.stream(generation_stream):
            logits = self.engine.model(tokens[:, None], cache=batch)[:, -1, :]
            return logits - mx.logsumexp(logits, axis=-1, keepdims=True)

    def _take(self, r: _Row, token: int, now: float) -> None:
        if not r.generated:
            r.ttft = now - r.start
            r.first = now
        r.last = now
        r.generated.append(token)
        if r.sampled:
            chosen, ids, values = r.sampled.pop(0)
            report = (chosen.item(), ids.tolist(), values.tolist())
            r.logprobs.append(constrain.entry(self.engine.tokenizer, token, *report))
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
        spelled = engine.reply_spelled(reply, row.stops.kept(row.generated))
        cache = row.cache if row.cache is not None else []
        ran = len(row.tokens) + len(row.generated)
        if row.stopped_in_prefill:
            ran = kinds.offset(cache) or row.hit.length
        full, coord, session = row.tokens + row.generated, engine.coord, row.request.session
        if ran > 0 and cache:
            coord.store(full, cache, ran, session, row.decision, row.events)
        row.cache = None
        coord.cap(row.decision, engine.cache.path(full[:ran]), ran, session, row.events)
        row.events += coord.tier_events(row.decision)
        stats, entries = coord.stats(), coord.changed_entries()
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
            reply_tokens=spelled,
            disk_written=coord.take_written(),
            logprobs=row.logprobs if row.request.logprobs is not None else None,
            draft_tokens=row.drafter.drafted if row.drafter is not None else 0,
            accepted_tokens=row.drafter.accepted if row.drafter is not None else 0,
            speculation=batch_drafts.why_not(row.request),
        )


def answer_batch(
    engine: Any,
    message: Batch,
    link: Any,
    stopped: set[Any],
    flow: TextFlow | None,
    box: JoinBox | None = None,
) -> None:
    """A `batch` message from the front end, run on this rank (every rank alike); rank 0
    (the one with a `link`, and a `flow` for the text) streams each row's text under the
    row's id, and each row's result as soon as the row ends. `stopped` holds the ids of
    rows the front end asked to stop (rank 0's only); `box` (rank 0's) the rows that
    join a batch sent with `join`."""
    ids = [row.id for row in message.rows]
    requests = [row.request for row in message.rows]

    def joins() -> list[TurnRequest]:
        assert box is not None
        rows = box.take()
        ids.extend(row.id for row in rows)
        return [row.request for row in rows]

    def on_text(i: int, piece: str) -> None:
        flow.add(ids[i], piece)

    def on_step() -> None:
        flow.step()

    def on_progress(i: int, done: int, total: int) -> None:
        link.send(Progress(ids[i], done, total))

    def on_row(i: int, outcome: RowOutcome) -> None:
        flow.flush()  # the row's last text comes before its result
        result = outcome.result
        link.send(Row(ids[i], outcome, result.reply_tokens if result is not None else None))

    if box is not None and message.join:
        box.open()
    try:
        run_batch(
            engine,
            requests,
            on_text=on_text if flow is not None else None,
            on_progress=on_progress if link is not None else None,
            # Every rank passes one (never true off rank 0): the stop is a collective.
            # Off rank 0 `ids` holds the first rows only: its `stopped` is always empty.
            should_stop=lambda i: i < len(ids) and ids[i] in stopped,
            on_step=on_step if flow is not None else None,
            on_row=on_row if flow is not None else None,
            joins=joins if box is not None and message.join else None,
            joinable=message.join,
        )
    finally:
        if box is not None and message.join:
            box.close()  # rows that came too late run next, as a batch of their own
        stopped.difference_update(ids)
