"""The five strategies, one turn each, on one shared model.

Every strategy turns the messages into tokens with the same renderer (the exokv
engine's own ``Engine.render``, shared by the runner, so the five see exactly the
same token sequences whatever that renderer does), prefills the tokens its cache
does not hold in chunks of ``exokv.rank.engine.PREFILL_STEP`` and decodes
greedily with mlx-lm's ``generate_step`` fed the last prompt token: the code path
of ``exokv.rank.engine.Engine``, which the ``exokv`` strategy runs itself. TTFT is
measured the same way everywhere: from the start of the turn (before the prompt
is tokenized and the cache is looked up) to the first generated token.

- ``cold``: a fresh cache every turn.
- ``carried``: one cache carried from turn to turn, as ``mlx_lm.chat`` does. If
  the new prompt does not extend the carried tokens (another conversation, or a
  history that differs from what was generated), it starts over with a fresh
  cache; it never trims.
- ``mlx-lm-lru``: ``mlx_lm.models.cache.LRUPromptCache`` used as ``mlx_lm.server``
  serves one request: ``fetch_nearest_cache``, a fresh cache if none, prefill
  the rest, generate, ``insert_cache`` of prompt + generated tokens. Its size
  limit is the server's default (``--prompt-cache-size 10``); with a byte budget
  it is held to it as ``mlx_lm.server --prompt-cache-bytes`` holds it: the
  server builds ``LRUPromptCache(prompt_cache_size)`` without ``max_bytes`` and,
  once a request's cache has been fetched, calls
  ``trim_to(n_bytes=budget - active)``, ``active`` being the bytes of the caches
  of the requests being served (here the one just fetched). Nothing is trimmed
  after ``insert_cache``, so between requests the LRU can hold more than the
  budget; what the server bounds is LRU + active cache at admission.
- ``exokv``: ``exokv.rank.engine.Engine``, the prefix cache (with a byte budget, its
  ``EngineOptions(budget=...)``: before each turn it evicts least recently used
  leaves until the stored bytes plus the turn's new tokens fit, and after the
  turn's insert again until the stored bytes are within the budget: a cap).
- ``exokv+disk``: the same engine with a disk tier under its RAM budget (entries
  evicted from RAM spill to this run's directory and load back on a hit).
"""

from __future__ import annotations

import copy
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.generate import generate_step, generation_stream
from mlx_lm.models.cache import LRUPromptCache, make_prompt_cache, trim_prompt_cache
from mlx_lm.sample_utils import make_sampler

from exokv.cache.prefix_cache import cache_length
from exokv.collectives import Group
from exokv.core.options import KvQuant
from exokv.core.records import TurnRequest
from exokv.rank.engine import Engine, EngineOptions, decode, prefill

LRU_MAX_SIZE = 10  # mlx_lm.server --prompt-cache-size default
# The strategies --cache-budget limits. cold holds nothing between turns; carried holds
# one conversation and resets on a switch, as mlx_lm.chat does (it has no byte limit).
BUDGETED = ("mlx-lm-lru", "exokv", "exokv+disk")
DISK_BUDGET = 1 << 40  # exokv+disk: the disk tier is not the bench's limit
MODEL_KEY = ("exokv-bench", None, None)  # stands for mlx_lm.server's model_key


@dataclass
class Outcome:
    """One strategy's turn."""

    reply: str
    prompt_tokens: int
    cached_tokens: int
    prefilled_tokens: int
    generated_tokens: int
    ttft_s: float
    decode_tps: float
    overhead_s: float  # cache lookup + insert (exokv: the engine's own overhead)
    cache_bytes: int  # held by the strategy's cache after the turn
    # Under --cache-budget: the bytes the strategy's own budget policy bounds
    # (mlx-lm-lru: LRU + active cache right after trim_to; exokv: stored bytes
    # after the turn), and the entries its policy evicted this turn.
    budget_bytes: int | None = None
    # ... and the least the policy could have got that down to: the active cache
    # (mlx-lm-lru); the entries on the path the turn is served from, which stay
    # locked while in use (a partly matched entry counts whole), plus the turn's new
    # tokens (exokv). Over the budget: unavoidable for that policy.
    budget_floor_bytes: int | None = None
    evicted: int = 0
    tokens: list[int] | None = None  # prompt tokens (not for exokv)
    generated: list[int] | None = None  # generated token ids (exokv: without the end token)
    note: str = ""
    spilled: int = 0  # exokv+disk: entries spilled to disk this turn
    loaded_tokens: int = 0  # exokv+disk: tokens loaded back from disk this turn
    drift_tokens: int | None = None  # --kv-bits: generated tokens equal to cold's before
    # the first difference (None: the reply equals cold's)


Render = Callable[[Sequence[dict[str, str]]], list[int]]


def render(tokenizer: Any, messages: Sequence[dict[str, str]]) -> list[int]:
    """The plain chat template as text, then the tokenizer (for warming up and sizing)."""
    text = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
    return list(tokenizer.encode(text, add_special_tokens=False))


def cache_nbytes(cache: Sequence[Any] | None) -> int:
    return sum(c.nbytes for c in cache) if cache else 0


class MlxStrategy:
    """The common turn of cold, carried and mlx-lm-lru: lookup, prefill, decode, store."""

    name = ""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        render_fn: Render | None = None,
        budget: int | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.render = render_fn or (lambda messages: render(tokenizer, messages))
        self.last_cache: list[Any] | None = None  # the cache the last turn ended with
        self.budget = budget  # only mlx-lm-lru applies it; cold and carried ignore it
        self.budget_bytes: int | None = None  # set by lookup under a budget
        self.budget_floor: int | None = None
        self.evicted = 0
        self.setup()

    def setup(self) -> None:
        """A strategy's own state, set up at the end of the common constructor."""

    def turn(
        self, conversation: str, messages: Sequence[dict[str, str]], max_tokens: int
    ) -> Outcome:
        start = time.perf_counter()
        tokens = self.render(messages)
        tic = time.perf_counter()
        self.budget_bytes, self.budget_floor, self.evicted = None, None, 0
        cache, cached, note = self.lookup(conversation, tokens)
        overhead = time.perf_counter() - tic
        if not 0 <= cached < len(tokens):
            raise AssertionError(f"{self.name}: a lookup must leave a token to run")
        prefill(self.model, cache, tokens[cached:-1])
        generated, reply, _, ttft, tps = decode(
            self.model, self.tokenizer, tokens[-1:], cache, max_tokens, start
        )
        tic = time.perf_counter()
        # generate_step has run every token it yielded, so the cache holds them all.
        held = tokens + generated
        if cache_length(cache) != len(held):
            raise AssertionError(f"{self.name}: the cache holds {cache_length(cache)} tokens")
        self.store(conversation, held, cache)
        overhead += time.perf_counter() - tic
        self.last_cache = cache
        return Outcome(
            reply=reply,
            prompt_tokens=len(tokens),
            cached_tokens=cached,
            prefilled_tokens=len(tokens) - cached,
            generated_tokens=len(generated),
            ttft_s=ttft,
            decode_tps=tps,
            overhead_s=overhead,
            cache_bytes=self.cache_bytes(),
            budget_bytes=self.budget_bytes,
            budget_floor_bytes=self.budget_floor,
            evicted=self.evicted,
            tokens=tokens,
            generated=generated,
            note=note,
        )

    def lookup(self, conversation: str, tokens: list[int]) -> tuple[list[Any], int, str]:
        raise NotImplementedError

    def store(self, conversation: str, held: list[int], cache: list[Any]) -> None:
        pass

    def cache_bytes(self) -> int:
        return 0


class Cold(MlxStrategy):
    name = "cold"

    def lookup(self, conversation: str, tokens: list[int]) -> tuple[list[Any], int, str]:
        return make_prompt_cache(self.model), 0, ""


class Carried(MlxStrategy):
    """One cache for whatever conversation comes next, reset when it is not extended."""

    name = "carried"

    def setup(self) -> None:
        self.budget = None  # one conversation: no budget
        self.cache: list[Any] | None = None
        self.held: list[int] = []
        self.conversation: str | None = None
        self.resets = {"switch": 0, "history": 0}

    def lookup(self, conversation: str, tokens: list[int]) -> tuple[list[Any], int, str]:
        n = len(self.held)
        if self.cache is not None and n < len(tokens) and tokens[:n] == self.held:
            return self.cache, n, ""
        note = ""
        if self.cache is not None:
            note = "reset: switch" if conversation != self.conversation else "reset: history"
            self.resets[note.split(": ")[1]] += 1
        self.cache, self.held = None, []
        return make_prompt_cache(self.model), 0, note

    def store(self, conversation: str, held: list[int], cache: list[Any]) -> None:
        self.cache, self.held, self.conversation = cache, held, conversation

    def cache_bytes(self) -> int:
        return cache_nbytes(self.cache)


class MlxLmLru(MlxStrategy):
    """mlx_lm.server's prompt cache, called as its single-request path calls it."""

    name = "mlx-lm-lru"

    def setup(self) -> None:
        # As mlx_lm.server builds it: LRUPromptCache(cli_args.prompt_cache_size), no
        # max_bytes; --prompt-cache-bytes is applied with trim_to in lookup.
        self.lru = LRUPromptCache(LRU_MAX_SIZE)

    def lookup(self, conversation: str, tokens: list[int]) -> tuple[list[Any], int, str]:
        cache, rest = self.lru.fetch_nearest_cache(MODEL_KEY, list(tokens))
        if cache is None:
            cache = make_prompt_cache(self.model)
        if self.budget is not None:
            # mlx_lm.server, once the request's cache is fetched and handed to the
            # batch: trim_to(n_bytes=prompt_cache_bytes - batch_generator.prompt_cache_nbytes).
            active = cache_nbytes(cache)
            before = len(self.lru)
            self.lru.trim_to(n_bytes=self.budget - active)
            self.evicted = before - len(self.lru)
            self.budget_bytes = int(self.lru.nbytes) + active
            self.budget_floor = active
        cached = len(tokens) - len(rest)
        if cached == len(tokens):
            # An exact hit: the last token must run again to give the first logits.
            trim_prompt_cache(cache, 1)
            cached -= 1
        return cache, cached, ""

    def store(self, conversation: str, held: list[int], cache: list[Any]) -> None:
        self.lru.insert_cache(MODEL_KEY, list(held), cache)

    def cache_bytes(self) -> int:
        return int(self.lru.nbytes)


class Exokv:
    """The exokv engine with its prefix cache, called as the chat calls it."""

    name = "exokv"

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        render_fn: Render | None = None,
        budget: int | None = None,
        group: Group | None = None,
        disk_dir: str | None = None,
        kv: KvQuant = KvQuant(),
    ) -> None:
        self.budget = budget
        self.disk_dir = disk_dir  # exokv+disk: its disk tier's directory
        options = EngineOptions(budget=budget, kv=kv)
        if disk_dir is not None:
            self.name = "exokv+disk"
            options.disk_dir, options.disk_budget = disk_dir, DISK_BUDGET
        # On several ranks, the group makes the engine's one gather per turn real.
        self.engine = Engine(model, tokenizer, group=group, options=options)
        self.render: Render = self.engine.render  # the renderer every strategy uses
        self.last_cache = None

    def turn(
        self, conversation: str, messages: Sequence[dict[str, str]], max_tokens: int
    ) -> Outcome:
        locked = 0
        if self.budget is not None:  # before the turn, outside its timings
            cache = self.engine.cache
            tokens = self.engine.render(messages)
            path = cache.tree.match(tokens[:-1]).path
            locked = sum(cache.entry_bytes(n) for n in path if n.start < len(tokens) - 1)
        result = self.engine.turn(
            TurnRequest(session=conversation, messages=list(messages), max_tokens=max_tokens)
        )
        return Outcome(
            reply=result.reply,
            prompt_tokens=result.prompt_tokens,
            cached_tokens=result.cached_tokens,
            prefilled_tokens=result.prefilled_tokens,
            generated_tokens=result.generated_tokens,
            ttft_s=result.ttft_s,
            decode_tps=result.decode_tps,
            overhead_s=result.overhead_s,
            cache_bytes=self.cache_bytes(),
            budget_bytes=self.cache_bytes() if self.budget is not None else None,
            budget_floor_bytes=(
                locked
                + (result.prompt_tokens + result.generated_tokens - result.cached_tokens)
                * self.bytes_per_token
                if self.budget is not None
                else None
            ),
            evicted=result.evictions,
            note=_eviction_note(result.events),
            generated=result.reply_tokens,
            spilled=sum(1 for e in result.events if e.kind == "spill"),
            loaded_tokens=sum(e.tokens for e in result.events if e.kind == "load"),
        )

    def restart(self) -> Exokv:
        """The strategy in a new process: exokv+disk keeps its disk tier, exokv nothing."""
        self.engine.close()
        o = self.engine.options
        again = Exokv.__new__(Exokv)
        again.budget, again.disk_dir, again.name = self.budget, self.disk_dir, self.name
        again.engine = Engine(self.engine.model, self.engine.tokenizer, self.engine.group, o)
        again.render, again.last_cache = again.engine.render, None
        # The chat's store gives a resumed session its replies' exact tokens: so here.
        again.engine.remember_replies(self.engine.prompt.remembered())
        return again

    def cache_bytes(self) -> int:
        return int(self.engine.cache.total_bytes)

    @property
    def bytes_per_token(self) -> int:
        return int(self.engine.bytes_per_token)


def _eviction_note(events: Sequence[Any]) -> str:
    """'3 evicted (budget rank 0)': how many entries the engine evicted, and why."""
    reasons = [e.reason for e in events if e.kind == "evict"]
    if not reasons:
        return ""
    why = ", ".join(f"{reasons.count(r)} {r}" for r in dict.fromkeys(reasons))
    return f"{len(reasons)} evicted ({why})"


def make(
    name: str,
    model: Any,
    tokenizer: Any,
    render_fn: Render | None = None,
    budget: int | None = None,
    group: Group | None = None,
    **exokv_options: Any,
) -> Any:
    """A strategy; `budget` (bytes) limits mlx-lm-lru and exokv only (see BUDGETED).

    `group` (several ranks) is for exokv's engine; the others need no collective of
    their own beyond the sharded model's.
    """
    if name == "exokv":
        return Exokv(model, tokenizer, render_fn, budget, group, **exokv_options)
    if name == "exokv+disk":
        where = tempfile.mkdtemp(prefix="exokv-bench-disk-")
        return Exokv(model, tokenizer, render_fn, budget, group, where, **exokv_options)
    return {"cold": Cold, "carried": Carried, "mlx-lm-lru": MlxLmLru}[name](
        model, tokenizer, render_fn, budget if name in BUDGETED else None
    )


def synchronize() -> None:
    """Wait for all queued work: the default stream's and generate_step's own stream.

    ``mx.synchronize()`` alone waits for the default stream only. The step that
    generate_step queues on its stream after the last token taken would otherwise
    run into the next timing, and on several ranks its collectives (a sharded
    forward pass) could interleave with the next prefill's in a different order
    on each rank, pairing the wrong messages.
    """
    mx.synchronize(generation_stream)
    mx.synchronize()


# -- the limit ------------------------------------------------------------------------


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class Oracle:
    """Every sequence run so far with its full cache: the best any prefix cache could serve.

    ``limit(tokens)`` measures the time to prefill only the tokens no earlier
    sequence holds, onto a copy of the cache that holds the rest (the copy and
    trim are not timed), and to produce the first token.
    """

    def __init__(self, model: Any) -> None:
        self.model = model
        self.entries: list[tuple[list[int], list[Any]]] = []

    def add(self, held: list[int], cache: list[Any]) -> None:
        # A sequence that the new one extends adds nothing: keep the longer one.
        self.entries = [(seq, c) for seq, c in self.entries if common_prefix(seq, held) < len(seq)]
        self.entries.append((held, cache))

    def best(self, tokens: Sequence[int]) -> tuple[int, list[Any] | None]:
        length, cache = 0, None
        for seq, c in self.entries:
            n = common_prefix(seq, tokens)
            if n > length:
                length, cache = n, c
        return min(length, len(tokens) - 1), cache

    def limit(self, tokens: list[int]) -> tuple[int, float]:
        """(the cached tokens of the limit, its TTFT)."""
        length, source = self.best(tokens)
        if source is not None and length > 0:
            cache = copy.deepcopy(source)
            trim_prompt_cache(cache, cache_length(cache) - length)
        else:
            length, cache = 0, make_prompt_cache(self.model)
        mx.eval([c.state for c in cache if not c.empty()])
        start = time.perf_counter()
        prefill(self.model, cache, tokens[length:-1])
        steps = generate_step(
            mx.array(tokens[-1:]),
            self.model,
            prompt_cache=cache,
            max_tokens=1,
            sampler=make_sampler(temp=0.0),
        )
        for _ in steps:
            break
        elapsed = time.perf_counter() - start
        synchronize()  # the step generate_step queued after the first token
        return length, elapsed
