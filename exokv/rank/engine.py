"""One chat turn, run identically on every rank.

render -> fetch the longest usable cached prefix -> one collective, evict by plan
(exokv.cache.coordinate) -> prefill only the new tokens, in steps of about a quarter
of a second (exokv.rank.pace), each with one stop check -> decode -> insert -> evict
until every rank is within its budget. Every cache decision is made from the token
sequences (identical everywhere) and the numbers gathered in that one collective.

`Engine.turn` is these steps, one method each: `_prompt`, `_fetch`, `_gather`,
`_prefill_prompt`, `_reply`, `_store`, `_release`, `_finish`. It uses the cache only
through `PrefixCache` (fetch, held, path, release) and `Coordinator` (begin, store,
cap, finish); the tree itself goes only to the typeahead and draft helpers, which
read it.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache
from mlx_lm.sample_utils import make_sampler
from transformers.utils import logging as hf_logging

from exokv.cache import kinds, memory
from exokv.cache.coordinate import Coordinator, agree_classes
from exokv.cache.disk import DiskStore
from exokv.cache.disk_tier import DiskTier
from exokv.cache.prefix_cache import Hit, PrefixCache
from exokv.cache.radix import Node
from exokv.cache.tier_options import kv_group_misfit
from exokv.collectives import Group, LocalGroup
from exokv.config import DEFAULT_MEMORY_THRESHOLD, TEST_HOOKS
from exokv.core.options import KvQuant
from exokv.core.records import (
    CacheEvent,
    DraftCost,
    EntryInfo,
    RankStats,
    TurnRequest,
    TurnResult,
)
from exokv.errors import PromptTooLong, UsageError
from exokv.hosts.replicas import held_for, layer_ranges
from exokv.model import pipeline, templates
from exokv.prompt.markers import Marked
from exokv.prompt.render import PromptRenderer, RepliesByText
from exokv.rank import constrain, speculate, typeahead
from exokv.rank.draft import Drafter, PassCost, ScriptedDrafter
from exokv.rank.pace import Pace, aligned_step
from exokv.rank.speculate import STOP_CHECK_EVERY, Decoded, ReplyText, StepAgreement
from exokv.rank.stops import TextStops
from exokv.state.locks import LockHeld

PREFILL_STEP = 512  # a prefill step when nothing sizes it (the bench), and the largest


def _quiet_tokenizer_warnings() -> None:
    # transformers warns on stderr about a prompt over its maximum length; exokv
    # refuses such a prompt itself (PromptTooLong), in one line.
    hf_logging.set_verbosity_error()


@dataclass
class EngineOptions:
    budget: int | None = None  # this rank's --cache-budget; None: derived from RAM
    memory_threshold: float = DEFAULT_MEMORY_THRESHOLD
    max_kv_size: int | None = None
    seed: int | None = None
    ranks_here: int = 1  # ranks sharing this machine: the default budget is a share of its RAM
    # The disk tier (exokv.cache.disk_tier): this rank's directory and budget; off without both.
    disk_dir: str | None = None
    disk_budget: int | None = None
    # For each rank, the rank whose host keeps a copy of its files (exokv.hosts.replicas).
    replica_targets: tuple[int | None, ...] = ()
    plan: tuple[str, int] | None = None  # the chat and its plan's generation (DiskStore)
    kv: KvQuant = KvQuant()  # a quantized KV cache (mlx-lm's QuantizedKVCache), or not
    # The prompt format (exokv.model.templates): a template spec (None: the model's own
    # or a fallback), stop sequences besides the template's, a context limit (num_ctx).
    chat_template: str | None = None
    stops: tuple[str, ...] = ()
    context: int | None = None


class Engine:
    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        group: Group | None = None,
        options: EngineOptions | None = None,
        draft: Any = None,
        replies_by_text: bool = True,
    ) -> None:
        """`draft`: rank 0's draft model (exokv.rank.draft_model.DraftModel), or None.
        `replies_by_text`: keep replies' exact tokens by their text for messages that
        carry none (see `reply_tokens`); False on a rank, whose messages carry them."""
        self.model = model
        self.draft = draft
        self.tokenizer = tokenizer
        self.group = group or LocalGroup()
        self.options = options or EngineOptions()
        self.template = self._settle_template(model, tokenizer)
        # exokv.prompt.markers: raw prompts and tools ride in the messages
        self.prompt = PromptRenderer(Marked(tokenizer), self.template.text)
        self._eos = set(tokenizer.eos_token_ids)
        self.prompt.by_text = RepliesByText() if replies_by_text else None
        # Stop sequences: the template's (a base model's next "User:") and the model's own.
        self.stops = tuple(dict.fromkeys(self.template.stops + tuple(self.options.stops)))
        self.decision = 0
        # Rank 0's measure of the prefill rate sizes every rank's steps (exokv.rank.pace).
        self.pace = Pace(most=PREFILL_STEP)
        self.prefill_steps: list[int] = []  # the last turn's step sizes (the rank log)
        _quiet_tokenizer_warnings()
        context = getattr(getattr(model, "args", None), "max_position_embeddings", None)
        self.context: int | None = context if isinstance(context, int) and context > 0 else None
        if self.options.context is not None:  # ollama's num_ctx: a limit below the model's
            self.context = min(self.context or self.options.context, self.options.context)
        if self.options.seed is not None:
            mx.random.seed(self.options.seed)
        rates = self._measure_rates()
        self.cache = PrefixCache(self._new_cache, agree_classes(self.group, list(rates)))
        # What one token adds to this rank's cache (K/V of every attention layer).
        self.bytes_per_token = sum(r for c, r in rates.items() if c != kinds.STATE)
        self.budget = self.options.budget
        if self.budget is None:
            self.budget = self._default_budget()
        self.coord = Coordinator(
            self.cache, self.group, rates, self.budget, self.options.memory_threshold
        )
        self.draft_events: list[CacheEvent] = []  # typeahead steps', reported by the next turn
        self.last_draft: DraftCost | None = None  # the last typeahead step's draft, for the toolbar
        self.tier_notice = ""  # why the persisted disk tier was not used ("" if it was)
        self.layer_ranges: list[tuple[int, int]] = []  # every rank's layers, with a tier
        self.speculation = ""  # why the last turn decoded without drafts ("" if it did not)
        # What a verify pass costs here (rank 0's clock): drafts no longer than pays.
        self.pass_cost: PassCost | None = PassCost()
        if self.options.disk_dir is not None and self.options.disk_budget is not None:
            self._start_tier()

    def _measure_rates(self) -> dict[kinds.StorageClass, int]:
        """This rank's bytes per token (or per state) of each storage class, measured by
        running the model; on every rank alike, as a pipeline forward is collective."""
        try:
            return kinds.measure_rates(self._new_cache, self._run_one_token)
        except ValueError as err:
            kv = self.options.kv
            if not kv.bits:
                raise
            why = kv_group_misfit(self.model, kv.bits, kv.group_size, str(err))
            raise UsageError(why) from None

    def _default_budget(self) -> int:
        """This rank's cache budget without --cache-budget: from its share of the RAM."""
        ram = memory.sample(self.group.rank).ram_total // max(self.options.ranks_here, 1)
        model_bytes = sum(v.nbytes for _, v in _flat_params(self.model))
        return memory.default_budget(self.options.memory_threshold, ram, model_bytes)

    def _settle_template(self, model: Any, tokenizer: Any) -> templates.Settled:
        """The chat template every rank renders with (exokv.model.templates): the one asked
        for, the model's own, or a fallback (its `note`, which the client says in one
        line); generation stops on each end-of-turn token it implies."""
        args = getattr(model, "args", None)
        family = getattr(model, "model_type", None) or getattr(args, "model_type", None)
        settled = templates.settle(tokenizer, family, self.options.chat_template)
        add = getattr(tokenizer, "add_eos_token", None)
        for token in settled.ends:
            if add is not None and token not in tokenizer.eos_token_ids:
                add(str(token))
        return settled

    def _start_tier(self) -> None:
        """Open this rank's disk tier; every rank has one or none (one gather agrees, and
        tells each rank every rank's layers: the files are named by them)."""
        store, why = None, ""
        local = len({leaf.layer for leaf in self.cache.leaves})
        local_row = [1, local]
        rows = self.group.gather(local_row) if self.group.size > 1 else [local_row]
        pipelined = pipeline.stages(self.model) > 1 or self.group.size == 1
        ranges = layer_ranges([row[1] for row in rows], pipelined)
        targets = list(self.options.replica_targets) or [None] * self.group.size
        held_by = [held_for(targets, r) for r in range(self.group.size)]
        own = ranges[self.group.rank]
        self.layer_ranges = ranges
        try:
            held = [ranges[s] for s in held_by[self.group.rank]]
            store = DiskStore(Path(self.options.disk_dir), own, held, self.options.plan)
        except LockHeld as held_lock:
            who = f"pid {held_lock.pid}" if held_lock.pid else "another process"
            why = f"{self.options.disk_dir} is in use by another exokv chat ({who})"
        except OSError as err:
            why = f"{self.options.disk_dir} is unusable ({err.strerror or err})"
        rows = self.group.gather([0 if why else 1]) if self.group.size > 1 else [[int(not why)]]
        if not all(row[0] for row in rows):
            if store is not None:
                store.release()
            bad = next(r for r, row in enumerate(rows) if not row[0])
            self.tier_notice = why or f"rank {bad} cannot open its disk tier"
            if why:  # the rank that knows why says it
                where = f"rank {self.group.rank}: " if self.group.size > 1 else ""
                print(
                    f"exokv: disk tier off: {where}{why}; this chat keeps its KV cache in RAM only",
                    file=sys.stderr,
                )
            return
        tier = DiskTier(
            self.cache,
            store,
            self.group,
            self.options.disk_budget or 0,
            first_layer=own[0],
            held_by=held_by,
        )
        self.coord.set_tier(tier)
        self.tier_notice = tier.restore()  # one gather on every rank alike
        if self.tier_notice and self.group.rank == 0:
            print(f"exokv: disk tier: {self.tier_notice}", file=sys.stderr)

    def close(self) -> None:
        """Keep the cache for the next run (the disk tier); every rank alike, no collective."""
        self.coord.close()

    @property
    def collectives(self) -> int:
        return self.coord.collectives

    # -- the turn ---------------------------------------------------------------

    def render(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        """The prompt's tokens, with each earlier reply as the exact tokens its message
        carries (exokv.prompt.render). Used with and without the cache alike, so replies
        stay the same."""
        return self.prompt.render(messages)

    def reply_spelled(self, reply: str, generated: list[int]) -> list[int]:
        """The tokens a reply's message carries (its result's `reply_tokens`): what was
        generated, without the end of turn. Kept by text too where messages carry none."""
        tokens = [int(t) for t in generated if t not in self._eos]
        if self.prompt.by_text is not None:
            self.prompt.by_text.remember(reply, tokens)
        return tokens

    def turn(
        self,
        request: TurnRequest,
        on_text: Callable[[str], None] | None = None,
        on_progress: Callable[[int, int], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> TurnResult:
        """One turn, the same steps on every rank. Each step that changes which tokens the
        cache holds (the fetch's hit, the plan's evictions, the inserts, the cap) decides
        from the token sequences and the numbers of `_gather`'s one collective only, so
        every rank makes the same change; this rank's own bytes and RAM never decide alone."""
        start = time.perf_counter()
        if request.sample_seed is not None:
            mx.random.seed(request.sample_seed)  # every rank alike: the request is broadcast
        tokens = self._prompt(request.messages)
        request = within_context(request, len(tokens), self.context)
        turn = self._fetch(request, tokens, start)
        try:
            self._gather(turn)
            stopped = self._prefill_prompt(turn, on_progress, should_stop)
            out = self._reply(turn, stopped, on_text, should_stop)
            self._store(turn, out)
        finally:
            self._release(turn)
        return self._finish(turn, out)

    def _prompt(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """The prompt's tokens; one over the context is refused before any collective."""
        tokens = self.render(messages)
        if self.context is not None and len(tokens) > self.context:
            raise PromptTooLong(
                f"the prompt is {len(tokens):,} tokens and the model's context is "
                f"{self.context:,}: not run (shorten the message, or /new to leave the "
                "earlier turns behind)",
                tokens=len(tokens),
                context=self.context,
            )
        return tokens

    def _fetch(self, request: TurnRequest, tokens: list[int], start: float) -> _Turn:
        """A new decision and its hit: the longest usable cached prefix (from the tree,
        so the same length on every rank), locked until `_release`; an empty one without
        the cache. The turn's events start with the typeahead steps' since the last turn."""
        tic = time.perf_counter()
        self.decision += 1
        self.coord.set_pins(request.pins)
        self.prefill_steps = []
        events, self.draft_events = self.draft_events, []
        expect = len(tokens) + request.max_tokens  # the most tokens this turn's cache holds
        if request.use_cache:
            drafted = typeahead.drafted_spans(self.cache.tree, tokens)  # before fetch touches them
            hit = self.cache.fetch(tokens, expect=expect, lend=self.cache.exact_anywhere)
        else:
            drafted, hit = [], Hit(self._new_cache(), 0, [])
        turn = _Turn(request, tokens, hit, events, start, ran=hit.length)
        turn.typed_ahead = typeahead.covered(drafted, hit.length)
        events += self.coord.tier_events(self.decision)  # loads, or agreed misses
        if hit.entry is not None:
            events.append(self._event("hit", hit.entry, request.session, hit.length))
            if turn.typed_ahead:
                used = self._event("draft-used", hit.entry, request.session, hit.length)
                used.tokens = turn.typed_ahead
                events.append(used)
        turn.overhead += time.perf_counter() - tic
        return turn

    def _gather(self, turn: _Turn) -> None:
        """The turn's one collective (exokv.cache.coordinate): every rank's numbers, then
        the same evictions on every rank by the plan, so that the turn's tokens fit."""
        tic = time.perf_counter()
        request, tokens, hit = turn.request, turn.tokens, turn.hit
        # What the tree does not hold yet is what this turn can add to it; what the
        # turn holds besides: its cache's room up to mlx-lm's step, and a copy of
        # the hit where the tree did not lend it.
        turn.meets = self.cache.held(tokens) if request.use_cache else 0
        expect = len(tokens) + request.max_tokens
        copied = 0 if hit.lent or not request.use_cache else hit.length
        new_tokens = len(tokens) - turn.meets + request.max_tokens + cache_room(expect)
        probe = memory.sample(self.group.rank)
        self.coord.begin(self.decision, new_tokens, probe, turn.events, copied=copied)
        turn.overhead += time.perf_counter() - tic

    def _prefill_prompt(
        self,
        turn: _Turn,
        on_progress: Callable[[int, int], None] | None,
        should_stop: Callable[[], bool] | None,
    ) -> bool:
        """Prefill what the hit does not hold, up to each of `_stops`, storing each stop
        reached where the tree needs it. Returns True when stopped (every rank agrees)."""
        tokens, hit = turn.tokens, turn.hit
        store = turn.request.use_cache and not self.cache.exact_anywhere
        for stop in self._stops(len(tokens), hit.length, turn.meets):
            stopped = self._prefill(
                hit.cache,
                tokens[turn.ran : stop],
                turn.ran,
                len(tokens),
                on_progress,
                should_stop,
                self.prefill_steps,
            )
            if stopped:
                # Stopped (Ctrl-C): no reply; what was prefilled is kept (`_store`).
                turn.ran = kinds.offset(hit.cache) or turn.ran
                return True
            turn.ran = stop
            if store and stop > hit.length:
                with turn.timed():
                    self._insert(tokens, hit.cache, turn.ran, turn.request.session, turn.events)
        return False

    def _reply(
        self,
        turn: _Turn,
        stopped: bool,
        on_text: Callable[[str], None] | None,
        should_stop: Callable[[], bool] | None,
    ) -> Decoded:
        """Decode the reply (none when stopped in prefill), and remember its exact tokens."""
        if stopped:
            out = Decoded([], "", "interrupted", 0.0, 0.0)
        else:
            cache, request = turn.hit.cache, turn.request
            out = self._decode(turn.tokens, cache, request, turn.start, on_text, should_stop)
            turn.ran = len(turn.tokens) + len(out.tokens)  # decode ran every token it gave
        turn.reply_tokens = self.reply_spelled(out.reply, out.spelled)
        return out

    def _store(self, turn: _Turn, out: Decoded) -> None:
        """The turn's tokens and reply into the tree, as far as its cache ran them."""
        if turn.request.use_cache:
            full = turn.tokens + out.tokens
            with turn.timed():
                self._insert(full, turn.hit.cache, turn.ran, turn.request.session, turn.events)

    def _release(self, turn: _Turn) -> None:
        """Unlock the hit's path, and give lent K/V back to the tree (even on an error)."""
        if turn.request.use_cache:
            with turn.timed():
                self.cache.release(turn.hit)

    def _finish(self, turn: _Turn, out: Decoded) -> TurnResult:
        """The cap (evict, by the numbers `_gather` gathered, until every rank is within
        its budget), the disk tier's write-through, and the turn's result."""
        with turn.timed():
            if turn.request.use_cache:
                live = self.cache.path((turn.tokens + out.tokens)[: turn.ran])
                self.coord.cap(self.decision, live, turn.ran, turn.request.session, turn.events)
            stats, entries = self.coord.finish(self.decision, turn.events)
        return self._result(turn, out, stats, entries)

    def _result(
        self, turn: _Turn, out: Decoded, stats: list[RankStats], entries: list[EntryInfo]
    ) -> TurnResult:
        return TurnResult(
            session=turn.request.session,
            reply=out.reply,
            prompt_tokens=len(turn.tokens),
            cached_tokens=turn.hit.length,
            prefilled_tokens=len(turn.tokens) - turn.hit.length,
            generated_tokens=len(out.tokens),
            ttft_s=out.ttft,
            decode_tps=out.tps,
            overhead_s=turn.overhead,
            ranks=self.group.size,
            finish_reason=out.finish,
            decision=self.decision,
            events=turn.events,
            rank_stats=stats,
            entries=entries,
            typed_ahead_tokens=turn.typed_ahead,
            draft_tokens=out.drafted,
            accepted_tokens=out.accepted,
            model_draft_tokens=out.model_drafted,
            speculation=self.speculation,
            speculation_detail=out.detail,
            reply_tokens=turn.reply_tokens,
            disk_written=self.coord.take_written(),
            logprobs=out.logprobs,
        )

    def draft_step_tokens(self) -> int:
        """The tokens of the next typeahead step: what Enter waits for at most, so about
        a prefill step's time (exokv.rank.pace), and never over STEP_TOKENS."""
        return min(self.pace.tokens(), typeahead.STEP_TOKENS)

    def typeahead_step(
        self,
        session: str,
        messages: Sequence[dict[str, str]],
        draft: str,
        step_tokens: int = 0,
    ) -> int:
        """One step of prefill ahead of Enter (exokv.rank.typeahead): `step_tokens` (0:
        this engine's `draft_step_tokens`; rank 0 decides it for every rank) more tokens
        of the conversation with the draft's stable part, stored in the tree as draft
        entries. Every rank runs the same steps; a step's one collective is its plan's
        gather, and after it every rank is within its budget, as after a turn.
        Returns the draft's tokens still to prefill (0: none, or nothing to do)."""
        plan = typeahead.draft_tokens(self.render, messages, draft)
        if plan is None or (self.context is not None and len(plan.tokens) > self.context):
            return 0
        tokens = plan.tokens
        meets = self.cache.held(tokens)
        self.last_draft = DraftCost(session, len(tokens), meets)
        if meets >= len(tokens):
            return 0
        self.decision += 1
        events: list[CacheEvent] = []
        drafted = typeahead.draft_ids(self.cache.tree, tokens)
        size = step_tokens or self.draft_step_tokens()
        expect = min(len(tokens), meets + size)
        hit = self.cache.fetch(tokens, expect=expect, lend=self.cache.exact_anywhere)
        kept = pipeline.kept_window(hit.cache)
        if kept is not None:  # the step ends where a turn's would (exokv.rank.pace)
            size = aligned_step(kept.offset, size, kept.max_size)
        stop = min(len(tokens), hit.length + size)
        try:
            copied = 0 if hit.lent else hit.length
            probe = memory.sample(self.group.rank)
            new_tokens = stop - meets + cache_room(stop)
            self.coord.begin(self.decision, new_tokens, probe, events, copied=copied)
            tic = time.perf_counter()
            prefill(self.model, hit.cache, tokens[hit.length : stop])
            self.pace.took(stop - hit.length, time.perf_counter() - tic)
            added, changed = self._insert(tokens, hit.cache, stop, session, events)
        finally:
            self.cache.release(hit)
        path = self.cache.path(tokens[:stop])
        typeahead.put_draft_first(self.cache.tree, path, plan.history, drafted, added, changed)
        step = self._event("draft", path[-1], session, hit.length)
        step.tokens = stop - hit.length
        events.append(step)
        self.coord.cap(self.decision, path, stop, session, events)
        events += self.coord.tier_events(self.decision)
        self.draft_events += events
        held = self.cache.held(tokens)
        self.last_draft = DraftCost(session, len(tokens), held)
        if held < stop:
            return 0  # the budget did not keep it: no more steps for this draft
        return len(tokens) - stop

    def _stops(self, n: int, hit: int, meets: int) -> list[int]:
        """Where prefill pauses: the prompt's end (all but its last token, which decode
        runs), and before it, where the prompt leaves the tree (`meets`).

        With full attention only, any token of a stored path is a hit, so the turn's
        one insert after the reply serves every later prompt. Otherwise a point is a
        hit only where the tree holds the window slices and states of that point, which
        only this run can give, so the turn stores one at each stop it prefilled up to
        (the engine's loop): where the prompt leaves the tree (the tree is split there,
        and the next conversation sharing the prefix, a system prompt, starts there)
        and the prompt's end (so /retry, or any prompt that branches after this one's
        end, reuses all of it but the token decode runs)."""
        if self.cache.exact_anywhere or not hit < meets < n - 1:
            return [n - 1]
        return [meets, n - 1]

    def _insert(
        self, tokens: Sequence[int], cache: list[Any], length: int, session: str, events: list
    ) -> tuple[list[Node], list[Node]]:
        return self.coord.store(tokens, cache, length, session, self.decision, events)

    # -- replies' exact tokens by their text, for callers whose messages carry none ----
    #
    # The front ends' messages carry each reply's tokens (TurnRequest), so a rank and a
    # LocalClient keep none of this (replies_by_text=False). An Engine used directly,
    # with text-only conversations (exokv.bench, tests), still has replies found by
    # their text.

    def reply_tokens(self, reply: str) -> list[int] | None:
        """The exact tokens generated for `reply`, kept by its text (None: not kept)."""
        return self.prompt.by_text.get(reply) if self.prompt.by_text is not None else None

    def remember_replies(self, pairs: Sequence[tuple[str, Sequence[int]]]) -> None:
        """Keep replies' exact tokens by their text (a text-only conversation resumed)."""
        for reply, tokens in pairs:
            self.reply_spelled(reply, list(tokens))

    # -- model work -------------------------------------------------------------

    def _prefill(
        self,
        cache: list[Any],
        tokens: Sequence[int],
        done: int,
        total: int,
        on_progress: Callable[[int, int], None] | None,
        should_stop: Callable[[], bool] | None = None,
        steps: list[int] | None = None,
    ) -> bool:
        """Run the model over the tokens not yet cached (all but the last one), in steps
        of rank 0's pace, each after one stop check that carries its size to every rank;
        each step's size is added to `steps`, if given.

        Returns True when stopped between steps (every rank agrees, as in decode).
        """
        if on_progress:
            on_progress(done, total)
        size, began, at = 0, 0.0, 0

        def before(i: int) -> bool:
            nonlocal size, began, at
            began, at = time.perf_counter(), i
            stop, size = self._agreed_step(should_stop, self.pace.tokens())
            return stop

        def after(n: int) -> None:
            # The step's time with its stop check: what a Ctrl-C waits for at most.
            self.pace.took(n - at, time.perf_counter() - began)
            if steps is not None:
                steps.append(n - at)
            if on_progress:
                on_progress(done + n, total)

        return prefill(self.model, cache, tokens, before, after, size=lambda: size)

    def _agreed_step(self, should_stop: Callable[[], bool] | None, size: int) -> tuple[bool, int]:
        """Whether to stop now and the next prefill step's size: rank 0's, on every rank
        (one collective when several, which every rank calls at the same points)."""
        stop = should_stop() if should_stop is not None else False
        return self.group.any_with(stop, size) if self.group.size > 1 else (stop, size)

    def _agreed_stop(self, should_stop: Callable[[], bool] | None) -> bool:
        """Whether to stop now, the same answer on every rank (one collective when several).

        Every rank must call this at the same points, whether or not it has a stop source.
        """
        stop = should_stop() if should_stop is not None else False
        return self.group.any(stop) if self.group.size > 1 else stop

    def _decode(
        self,
        tokens: list[int],
        cache: list[Any],
        request: TurnRequest,
        start: float,
        on_text: Callable[[str], None] | None,
        should_stop: Callable[[], bool] | None,
    ) -> Decoded:
        """The reply after `tokens` (all but the last one in `cache`): with drafts from
        the turn's tokens checked by the model (exokv.rank.speculate) where the request
        and the cache allow it, else one token at a time."""
        self.speculation = self._why_not_speculate(cache, request)
        if not self.speculation:
            return self._decode_drafted(tokens, cache, request, start, on_text, should_stop)

        def stop(generated: int) -> bool:
            # Across ranks the check is a collective: every few tokens, at the same
            # tokens on every rank, so a Ctrl-C still lands within a few tokens.
            check = self.group.size == 1 or generated % STOP_CHECK_EVERY == 0
            return check and self._agreed_stop(should_stop)

        stops = TextStops(self.stops)
        grammar = constrain.for_request(self, request.grammar)
        reported: list[Any] = []

        def report(token: int, logprobs: mx.array) -> None:
            assert request.logprobs is not None
            top = constrain.top_logprobs(logprobs, token, request.logprobs)
            reported.append(constrain.entry(self.tokenizer, token, *top))

        tokens_out, reply, finish, ttft, tps = decode(
            self.model,
            self.tokenizer,
            tokens[-1:],
            cache,
            request.max_tokens,
            start,
            temp=request.temp,
            top_p=request.top_p,
            on_text=on_text,
            stop=stop,
            stops=stops,
            processors=[grammar.processor()] if grammar is not None else None,
            on_logprobs=report if request.logprobs is not None else None,
        )
        logprobs = reported if request.logprobs is not None else None
        kept = stops.kept(tokens_out)
        return Decoded(tokens_out, reply, finish, ttft, tps, spelled=kept, logprobs=logprobs)

    def _why_not_speculate(self, cache: list[Any], request: TurnRequest) -> str:
        """Why this turn decodes without drafts ("": it drafts), the same on every rank."""
        why = speculate.unsupported(cache) if request.speculate else "off"
        # A grammar's state and the logprobs follow each token as it is sampled; a
        # draft's tokens are checked in one pass: such a reply decodes one at a time.
        if request.grammar is not None:
            why = why or "a constrained reply decodes one token at a time"
        if request.logprobs is not None:
            why = why or "logprobs are read one token at a time"
        # Ranks holding different layer kinds (a window on one, none on another) must
        # all decode the same way: one rank that cannot trim turns drafts off for all.
        if request.speculate and self.group.size > 1:
            if self.group.any(bool(why)) and not why:
                why = "another rank's cache cannot be trimmed"
        if not why and request.temp > 0 and request.sample_seed is not None:
            # The distribution is the same with drafts, the random draws are not: a
            # seeded request must repeat whatever the cache holds.
            why = "a seeded sample repeats only without drafts"
        return why

    def _decode_drafted(
        self,
        tokens: list[int],
        cache: list[Any],
        request: TurnRequest,
        start: float,
        on_text: Callable[[str], None] | None,
        should_stop: Callable[[], bool] | None,
    ) -> Decoded:
        script = TEST_HOOKS.drafts()  # tests only: drafts that are partly wrong
        tree = self.cache.tree if request.use_cache else None
        if self.pass_cost is not None and self.pace.times:
            self.pass_cost.prefilled(self.pace.cost()[1])
        drafter = (
            ScriptedDrafter(tokens, script)
            if script is not None
            else Drafter(tokens, tree=tree, cost=self.pass_cost, model=self.draft)
        )
        out = speculate.decode(
            self.model,
            self.tokenizer,
            tokens[-1],
            cache,
            request.max_tokens,
            start,
            drafter,
            StepAgreement(self.group, should_stop),
            temp=request.temp,
            top_p=request.top_p,
            on_text=on_text,
            stops=TextStops(self.stops),
        )
        out.model_drafted = drafter.model_drafted
        return out

    def _new_cache(self) -> list[Any]:
        cache = make_prompt_cache(self.model, max_kv_size=self.options.max_kv_size)
        if self.options.kv.bits:  # stored quantized, in RAM and on disk alike
            bits, group = self.options.kv.bits, self.options.kv.group_size
            cache = [QuantizedKVCache(group, bits) if type(c) is KVCache else c for c in cache]
        return cache

    def _run_one_token(self, cache: list[Any]) -> None:
        self.model(mx.array([[0]]), cache=cache)
        mx.eval([kinds.arrays(c.state) for c in cache])

    # -- reporting --------------------------------------------------------------

    def entries(self) -> list[EntryInfo]:
        return self.coord.entries()

    def _event(self, kind: str, node: Node, session: str, hit: int = 0) -> CacheEvent:
        return self.coord.event(kind, node, session, self.decision, hit)


@dataclass
class _Turn:
    """One turn's state, handed from step to step of `Engine.turn`."""

    request: TurnRequest
    tokens: list[int]
    hit: Hit
    events: list[CacheEvent]
    start: float  # the turn's start (perf_counter): TTFT counts from it
    ran: int = 0  # tokens the turn's cache has run
    meets: int = 0  # tokens of the prompt the tree held at the fetch
    typed_ahead: int = 0  # tokens of the hit that typeahead steps prefilled
    overhead: float = 0.0  # seconds of cache work (fetch, gather, inserts, cap), not the model's
    reply_tokens: list[int] = field(default_factory=list)  # the reply as its message carries it

    @contextmanager
    def timed(self) -> Iterator[None]:
        tic = time.perf_counter()
        try:
            yield
        finally:
            self.overhead += time.perf_counter() - tic


def within_context(request: TurnRequest, prompt: int, context: int | None) -> TurnRequest:
    """`request`, its max_tokens cut to what the model's context leaves after a prompt
    of `prompt` tokens (at least 1): the reply ends there with finish_reason "length"
    (as OpenAI's does). Decided from the prompt and the config: alike on every rank."""
    if context is None or prompt + request.max_tokens <= context:
        return request
    return replace(request, max_tokens=max(1, context - prompt))


def cache_room(tokens: int) -> int:
    """A cache's room past `tokens`: mlx-lm allocates its K/V a step at a time, and the
    room is held as well (a turn's headroom counts it)."""
    return -(-tokens // KVCache.step) * KVCache.step - tokens


def prefill(
    model: Any,
    cache: list[Any],
    tokens: Sequence[int],
    before_chunk: Callable[[int], bool] | None = None,
    after_chunk: Callable[[int], None] | None = None,
    size: Callable[[], int] | None = None,
) -> bool:
    """Run the model over `tokens` into `cache`, a step at a time: size() tokens (asked
    after before_chunk), or PREFILL_STEP.

    before_chunk(tokens done) returning True stops it (returns True); after_chunk
    gets the tokens done so far. Across pipeline ranks a step runs as smaller pieces
    with no collective between them, so the ranks work on different pieces at once
    (exokv.model.pipeline.micro_chunks). The engine and the bench share this code path.
    """
    kept = pipeline.kept_window(cache)
    stages = pipeline.stages(model) if kept is None else 1
    slow = TEST_HOOKS.slow_prefill()  # tests only: a slow model
    # Two pipeline ranks: rank 0 waits for each piece asleep (exokv.wire.wake.PieceBell).
    bell = getattr(model, "piece_bell", None)
    i = 0
    while i < len(tokens):
        if before_chunk is not None and before_chunk(i):
            return True
        step = max(1, size() if size is not None else PREFILL_STEP)
        if kept is not None:  # where a step starts changes the reply (exokv.rank.pace)
            step = aligned_step(kept.offset, step, kept.max_size)
        end = min(i + step, len(tokens))
        for start, stop in pipeline.micro_chunks(i, end, stages):
            if bell is not None:
                bell.before_piece()
            model(mx.array(tokens[start:stop])[None], cache=cache)
            mx.eval([c.state for c in cache])
            if bell is not None:
                bell.after_piece()
        if slow:
            time.sleep(slow * (end - i))
        if after_chunk is not None:
            after_chunk(end)
        i = end
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
    top_p: float = 1.0,
    stops: TextStops | None = None,
    processors: list[Callable[[mx.array, mx.array], mx.array]] | None = None,
    on_logprobs: Callable[[int, mx.array], None] | None = None,
) -> tuple[list[int], str, str, float, float]:
    """Generate after `last` with mlx-lm's generate_step.

    Returns (token ids incl. an end-of-turn token, reply text, finish reason, TTFT
    measured from `start`, decode tokens/s). stop(tokens generated) is asked after
    each token; `stops` ends the reply at a stop sequence (the reply is the text
    before it; `stops.kept` gives its tokens). `processors` are mlx-lm's logits
    processors (a grammar's mask, exokv.rank.constrain); on_logprobs(token, its
    distribution's log-probabilities) is called for each token. The engine and the
    bench share this code path.
    """
    text = ReplyText(tokenizer, start, on_text, stops)
    finish = "length"
    steps = generate_step(
        mx.array(last),
        model,
        prompt_cache=cache,
        max_tokens=max_tokens,
        sampler=make_sampler(temp=temp, top_p=top_p),  # top_p 1.0: off
        logits_processors=processors,
    )
    for token, logprobs in steps:
        if on_logprobs is not None:
            on_logprobs(int(token), logprobs)
        if text.add(int(token)):
            finish = "stop"
            break
        if stop is not None and stop(len(text.tokens)):
            finish = "interrupted"
            break
        if len(text.tokens) >= max_tokens:
            break
    reply, ttft, tps = text.finish()
    return text.tokens, reply, finish, ttft, tps


def _flat_params(model: Any) -> list[tuple[str, mx.array]]:
    return tree_flatten(model.parameters())
