"""Run the scenarios through every strategy, interleaved, and summarise.

For each scenario and each of ``--repeat`` runs, every strategy starts empty and
the steps are played in order; at each step the five strategies and the limit
measurement run one after the other (the order rotates from one run to the
next, so drift and order effects hit all alike). The replies must be the same
for every strategy; the history continues with the cold reply, and any
difference is recorded as a mismatch (the CLI turns it into an error).

Per-turn figures are medians over the runs; totals are the median of the runs'
totals. Token counts and cache bytes are deterministic and taken from the first
run (a run that differs is recorded in ``nondeterministic``).
"""

from __future__ import annotations

import gc
import os
import shutil
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from exokv.bench import QUANTIZED, STRATEGIES, estimate, scenarios, targets
from exokv.bench.strategies import (
    BUDGETED,
    Cold,
    Oracle,
    Outcome,
    common_prefix,
    make,
    render,
    synchronize,
)
from exokv.cache import kinds
from exokv.cache.tier_options import check_kv_fits
from exokv.collectives import Group
from exokv.core.options import KvQuant

OTHERS = tuple(s for s in STRATEGIES if s != "exokv")
TIMINGS = ("ttft_s", "decode_tps", "overhead_s")


@dataclass
class BenchConfig:
    model: str
    turns: int = 8
    context: int = 2000
    reply_tokens: int = 32
    scenarios: list[str] = field(default_factory=lambda: list(scenarios.SCENARIOS))
    repeat: int = 1
    seed: int = 0
    ranks: int = 1
    parallel: str = "pipeline"
    cache_budget: int | None = None  # bytes, for mlx-lm-lru and exokv alike (BUDGETED)
    kv: KvQuant = KvQuant()  # quantized KV for exokv and exokv+disk (QUANTIZED)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BenchConfig:
        """The config as `asdict` sent it to the bench's ranks (exokv.bench.ranks); keys
        of a newer or older front end that this one lacks are left out."""
        known = {f.name for f in fields(cls)}
        given = {k: v for k, v in data.items() if k in known}
        if isinstance(given.get("kv"), dict):
            given["kv"] = KvQuant(**given["kv"])
        return cls(**given)


# What each budgeted strategy's policy bounds, as reported with --cache-budget.
BUDGET_ACCOUNTING = {
    "mlx-lm-lru": (
        "LRU bytes + the active request's cache, right after trim_to(n_bytes=budget - active) "
        "at admission (mlx_lm.server --prompt-cache-bytes); the reply's cache is inserted "
        "after that without a trim, so between requests the LRU alone can exceed the budget "
        "(peak_cache_bytes)"
    ),
    "exokv": (
        "stored prefix bytes after each turn (EngineOptions(budget=...): before the turn it "
        "evicts least recently used leaves until the stored bytes plus the turn's new tokens "
        "fit)"
    ),
    "exokv+disk": (
        "stored prefix bytes in RAM after each turn, as exokv; what leaves RAM is spilled to "
        "a disk tier (exokv.cache.disk_tier) and loaded back on a hit instead of prefilled"
    ),
}


def budget_note(budget: int | None) -> str:
    if budget is None:
        return (
            "no cache budget: mlx-lm-lru keeps up to 10 entries with no byte limit "
            "(mlx_lm.server's defaults), exokv its RAM-derived budget"
        )
    return (
        f"cache budget {budget} bytes for {' and '.join(BUDGETED)} (mlx-lm-lru as "
        "mlx_lm.server --prompt-cache-bytes, exokv as EngineOptions(budget=...)); "
        "cold and carried are not affected by it (cold keeps nothing, carried keeps one "
        "conversation and starts over on a switch, as mlx_lm.chat does)"
    )


class Progress:
    """What the runner reports to: the number of measurements, then one call per measurement."""

    def start(self, total: int, estimate: str = "") -> None:
        """`total` measurements; `estimate` says how long they will take, about."""

    def advance(self, description: str) -> None:
        pass


def plan_lengths(config: BenchConfig, tokenizer: Any) -> dict[str, int]:
    def r(messages: Sequence[dict[str, str]]) -> list[int]:
        return render(tokenizer, messages)

    return {
        name: len(scenarios.build(name, config.turns, config.context, r, config.seed))
        for name in config.scenarios
    }


def run(
    config: BenchConfig,
    model: Any,
    tokenizer: Any,
    progress: Progress | None = None,
    group: Group | None = None,
) -> dict[str, Any]:
    """The whole bench on this process's model (on several ranks: its shard, and every
    rank calls this alike, with `group` for exokv's engine; see bench.rank_main)."""
    progress = progress or Progress()
    load_start = _loadavg()
    check_kv_fits(model, config.kv)  # QUANTIZED strategies run: said before any turn
    lengths = plan_lengths(config, tokenizer)
    _warm_up(model, tokenizer)
    progress.start(
        sum(lengths.values()) * config.repeat * (len(STRATEGIES) + 1),
        _estimate(config, model, tokenizer),
    )
    results: dict[str, Any] = {}
    mismatches: list[dict[str, Any]] = []
    for name in config.scenarios:
        runs = []
        for rep in range(config.repeat):
            runs.append(_run_once(name, rep, config, model, tokenizer, progress, mismatches, group))
            gc.collect()
            mx.clear_cache()
        results[name] = _summarise(runs)
        if config.cache_budget is not None:
            _check_budget(results[name], config.cache_budget)
            _against_working_set(results[name], config.cache_budget)
    doc: dict[str, Any] = {
        "model": config.model,
        "ranks": config.ranks,
        "parallel": config.parallel,
        "turns": config.turns,
        "context": config.context,
        "reply_tokens": config.reply_tokens,
        "repeat": config.repeat,
        "seed": config.seed,
        "cache_budget": config.cache_budget,
        "cache_budget_strategies": list(BUDGETED) if config.cache_budget is not None else [],
        "cache_budget_note": budget_note(config.cache_budget),
        "kv_bits": config.kv.bits,
        "kv_group_size": config.kv.group_size if config.kv.bits else None,
        "strategies": list(STRATEGIES),
        "versions": _versions(),
        "machine": {
            "cpus": os.cpu_count(),
            "loadavg_start": load_start,  # other work on the machine skews every timing
            "loadavg_end": _loadavg(),
        },
        "replies_match": not mismatches,
        "mismatches": mismatches,
        "scenarios": results,
    }
    doc["targets"] = targets.grade(doc)
    return doc


# -- one run of one scenario ------------------------------------------------------------


def _run_once(
    name: str,
    rep: int,
    config: BenchConfig,
    model: Any,
    tokenizer: Any,
    progress: Progress,
    mismatches: list[dict[str, Any]],
    group: Group | None = None,
) -> dict[str, Any]:
    """One run of scenario `name`: every strategy from empty, the steps in order, each
    step's strategies in an order rotated by `rep`; replies are checked against cold's."""
    budget = config.cache_budget
    strategies, r = _strategies(config, model, tokenizer, group)
    scen = scenarios.build(name, config.turns, config.context, r, config.seed)
    oracle = Oracle(model)
    order = [*STRATEGIES, "limit"]
    shift = rep % len(order)
    order = order[shift:] + order[:shift]
    tally = _Tally()
    while (step := scen.next_step()) is not None:
        if step.index == scen.restart_at:  # a new process: exokv+disk keeps its disk tier
            for s in STRATEGIES:
                restart = getattr(strategies[s], "restart", None)
                strategies[s] = restart() if restart else make(s, model, tokenizer, r, budget)
        tokens = r(step.messages)
        where = f"{name} {rep + 1}/{config.repeat} turn {step.index}/{len(scen)}"
        outcomes, limit = _play(step, tokens, order, strategies, oracle, config, progress, where)
        ref = outcomes["cold"]
        for s, o in outcomes.items():
            if _differs(o, ref, s, config.kv.bits, tokenizer):
                mismatches.append(
                    {"scenario": name, "run": rep + 1, "turn": step.index, "strategy": s}
                    | {"reply": o.reply, "cold_reply": ref.reply}
                )
        cold: Cold = strategies["cold"]
        held = (ref.tokens or []) + (ref.generated or [])
        oracle.add(held, cold.last_cache)
        tally.distinct += _trie_add(tally.trie, held)
        ideal = max((common_prefix(tokens, h) for h in tally.seen), default=0)
        ideal = max(limit[0], min(ideal, len(tokens) - 1))
        tally.seen.append(r([*step.messages, {"role": "assistant", "content": ref.reply}]))
        scen.commit(step, ref.reply)
        tally.add(step, tokens, outcomes, limit, ideal)
    _drop_disk_files(strategies["exokv+disk"])
    return {
        "restart_at": scen.restart_at,
        "kv_bits": config.kv.bits,
        "kv": _unquantized_kv(model),
        "turns": tally.rows,
        "peak_cache_bytes": tally.peak,
        "budget_peak_bytes": tally.budget_peak,
        "distinct_tokens": tally.distinct,
        "bytes_per_token": strategies["exokv"].bytes_per_token,
        "carried_resets": dict(strategies["carried"].resets),
    }


def _strategies(
    config: BenchConfig, model: Any, tokenizer: Any, group: Group | None
) -> tuple[dict[str, Any], Callable[[Sequence[dict[str, str]]], list[int]]]:
    """Every strategy, made empty, and the renderer they all use: the exokv engine's
    (the current one: see the restart), so the token sequences are the same for all."""
    budget = config.cache_budget
    exo = make("exokv", model, tokenizer, budget=budget, group=group, kv=config.kv)
    strategies: dict[str, Any] = {"exokv": exo}

    def r(messages: Sequence[dict[str, str]]) -> list[int]:
        return strategies["exokv"].render(messages)

    for s in STRATEGIES:
        if s != "exokv":
            strategies[s] = make(s, model, tokenizer, r, budget, group=group, kv=config.kv)
    return strategies, r


def _play(
    step: scenarios.Step,
    tokens: list[int],
    order: Sequence[str],
    strategies: dict[str, Any],
    oracle: Oracle,
    config: BenchConfig,
    progress: Progress,
    where: str,
) -> tuple[dict[str, Outcome], tuple[int, float]]:
    """One step through every strategy and the limit, in `order`; returns the
    strategies' outcomes (in STRATEGIES' order) and the limit's (cached tokens, TTFT)."""
    outcomes: dict[str, Outcome] = {}
    limit = (0, 0.0)
    for s in order:
        progress.advance(f"{where} {s}")
        if s == "limit":
            limit = oracle.limit(tokens)
        else:
            outcomes[s] = strategies[s].turn(step.conversation, step.messages, config.reply_tokens)
        synchronize()  # work generate_step queued must not run into the next timing
    return {s: outcomes[s] for s in STRATEGIES}, limit


def _differs(o: Outcome, ref: Outcome, s: str, kv_bits: int | None, tokenizer: Any) -> bool:
    """Whether strategy `s`'s outcome is a mismatch against cold's `ref`. A quantized
    strategy is not expected to equal it: how far apart goes in its `drift_tokens`."""
    if kv_bits and s in QUANTIZED:
        if o.reply != ref.reply:
            cold_tokens = [t for t in ref.generated or [] if t not in _eos(tokenizer)]
            o.drift_tokens = common_prefix(o.generated or [], cold_tokens)
        return False
    mine = (o.reply, o.generated_tokens, o.prompt_tokens)
    return mine != (ref.reply, ref.generated_tokens, ref.prompt_tokens)


@dataclass
class _Tally:
    """What one run adds up, turn by turn."""

    # Earlier conversations as rendered, replies included (a rendered reply may differ
    # from the generated tokens: the ideal counts it all).
    seen: list[list[int]] = field(default_factory=list)
    trie: dict[int, Any] = field(default_factory=dict)
    distinct: int = 0
    peak: dict[str, int] = field(default_factory=lambda: dict.fromkeys(STRATEGIES, 0))
    budget_peak: dict[str, int] = field(default_factory=dict)
    rows: list[dict[str, Any]] = field(default_factory=list)

    def add(
        self,
        step: scenarios.Step,
        tokens: list[int],
        outcomes: dict[str, Outcome],
        limit: tuple[int, float],
        ideal: int,
    ) -> None:
        for s in STRATEGIES:
            self.peak[s] = max(self.peak[s], outcomes[s].cache_bytes)
            if outcomes[s].budget_bytes is not None:
                self.budget_peak[s] = max(self.budget_peak.get(s, 0), outcomes[s].budget_bytes)
        self.rows.append(
            {
                "turn": step.index,
                "conversation": step.conversation,
                "action": step.action,
                "prompt_tokens": len(tokens),
                "limit_cached_tokens": limit[0],
                "ideal_cached_tokens": ideal,
                "limit_ttft_s": limit[1],
                "strategies": {s: _row(outcomes[s]) for s in STRATEGIES},
            }
        )


def _drop_disk_files(disk: Any) -> None:
    """exokv+disk's disk tier's files go with the run."""
    if disk.engine.coord.tier is not None:
        disk.engine.coord.tier.store.flush()
        shutil.rmtree(disk.disk_dir, ignore_errors=True)


def _eos(tokenizer: Any) -> set[int]:
    return set(getattr(tokenizer, "eos_token_ids", []) or [])


def _unquantized_kv(model: Any) -> dict[str, Any]:
    """What one token adds to the model's own, unquantized cache on this rank: bytes in
    the model's KV dtype, that dtype, and the same elements at 2 bytes each (fp16).
    Every rank calls it alike (a pipeline forward is itself collective)."""
    made: list[list[Any]] = []

    def make() -> list[Any]:
        made.append(make_prompt_cache(model))
        return made[-1]

    def run(cache: list[Any]) -> None:
        model(mx.array([[0]]), cache=cache)
        mx.eval([kinds.arrays(c.state) for c in cache])

    rates = kinds.measure_rates(make, run)
    per_token = sum(rate for c, rate in rates.items() if c != kinds.STATE)
    found = [a.dtype for c in made[0] for a in kinds.arrays(c.state)]
    dtype = found[0] if found else mx.float32
    return {
        "bytes_per_token": per_token,
        "dtype": str(dtype).removeprefix("mlx.core."),
        "bytes_per_token_fp16": per_token * 2 // dtype.size,
    }


def _row(o: Outcome) -> dict[str, Any]:
    d = asdict(o)
    for k in ("tokens", "generated"):
        d.pop(k)
    return d


def _trie_add(trie: dict[int, Any], tokens: Sequence[int]) -> int:
    """Insert into a token trie; returns how many new nodes (distinct tokens) it took."""
    added = 0
    node = trie
    for t in tokens:
        nxt = node.get(t)
        if nxt is None:
            nxt = node[t] = {}
            added += 1
        node = nxt
    return added


def _estimate(config: BenchConfig, model: Any, tokenizer: Any) -> str:
    """How long the run will take, about (exokv.bench.estimate): one cold turn measured."""

    def r(messages: Sequence[dict[str, str]]) -> list[int]:
        return render(tokenizer, messages)

    def turn(messages: list[dict[str, str]], max_tokens: int) -> Any:
        return Cold(model, tokenizer).turn("rates", messages, max_tokens)

    rates = estimate.measure(turn, r, config.context, config.reply_tokens)
    prompts = estimate.step_prompts(config.scenarios, config.turns, config.context, config.seed, r)
    total = estimate.seconds(prompts, config.reply_tokens, config.repeat, rates)
    return estimate.say(total, len(prompts), config.repeat, rates)


def _warm_up(model: Any, tokenizer: Any) -> None:
    """One untimed turn, so the first timed turn pays no one-off start-up cost."""
    messages = [{"role": "user", "content": "Warm up the model, please."}]
    Cold(model, tokenizer).turn("warm-up", messages, 4)
    synchronize()


# -- medians and totals ---------------------------------------------------------------


def _median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def _summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    first = runs[0]
    turns, nondeterministic = _merge_turns(runs)
    prompt_total = sum(t["prompt_tokens"] for t in turns)
    summary: dict[str, Any] = {
        "strategies": {s: _strategy_summary(s, runs, turns, prompt_total) for s in STRATEGIES}
    }
    exokv_total = summary["strategies"]["exokv"]["total_ttft_s"]
    summary["speedup"] = {
        s: summary["strategies"][s]["total_ttft_s"] / exokv_total if exokv_total else 0.0
        for s in OTHERS
    }
    summary["limit"] = {
        "total_ttft_s": _median([sum(t["limit_ttft_s"] for t in r["turns"]) for r in runs]),
        "cached_fraction": sum(t["limit_cached_tokens"] for t in turns) / prompt_total,
        "ideal_cached_fraction": sum(t["ideal_cached_tokens"] for t in turns) / prompt_total,
    }
    summary["distinct_tokens"] = first["distinct_tokens"]
    summary["bytes_per_token"] = [first["bytes_per_token"]]  # exokv's cache (--kv-bits)
    kv = first["kv"]
    summary["kv_dtype"] = kv["dtype"]
    summary["bytes_per_token_unquantized"] = [kv["bytes_per_token"]]
    summary["bytes_per_token_fp16"] = [kv["bytes_per_token_fp16"]]
    summary["bytes_vs_fp16"] = [first["bytes_per_token"] / kv["bytes_per_token_fp16"]]
    if first.get("restart_at"):
        summary["restart_at"] = first["restart_at"]
        summary["after_restart"] = _after_restart(turns, first["restart_at"])
    summary["ideal_cache_bytes"] = [first["distinct_tokens"] * first["bytes_per_token"]]
    summary["last_prompt_tokens"] = turns[-1]["prompt_tokens"] if turns else 0
    summary["max_prompt_tokens"] = max((t["prompt_tokens"] for t in turns), default=0)
    summary["nondeterministic"] = nondeterministic
    summary["turns"] = turns
    return summary


def _merge_turns(runs: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The first run's turns with the runs' median timings, and the turns where a run's
    token counts differ from the first's (nondeterministic)."""
    nondeterministic = []
    turns = []
    for i, row in enumerate(runs[0]["turns"]):
        merged = {k: v for k, v in row.items() if k != "strategies"}
        merged["limit_ttft_s"] = _median([run["turns"][i]["limit_ttft_s"] for run in runs])
        merged["strategies"] = {}
        for s in STRATEGIES:
            cell = dict(row["strategies"][s])
            for key in TIMINGS:
                cell[key] = _median([run["turns"][i]["strategies"][s][key] for run in runs])
            for run in runs[1:]:
                other = run["turns"][i]["strategies"][s]
                if any(other[k] != cell[k] for k in ("prompt_tokens", "cached_tokens")):
                    nondeterministic.append({"turn": row["turn"], "strategy": s})
            merged["strategies"][s] = cell
        turns.append(merged)
    return turns, nondeterministic


def _strategy_summary(
    s: str, runs: list[dict[str, Any]], turns: list[dict[str, Any]], prompt_total: int
) -> dict[str, Any]:
    """Strategy `s`'s totals over the merged turns (and its own figures, by strategy)."""
    first = runs[0]
    cells = [t["strategies"][s] for t in turns]
    cached = sum(c["cached_tokens"] for c in cells)
    entry = {
        "total_ttft_s": _median(
            [sum(t["strategies"][s]["ttft_s"] for t in r["turns"]) for r in runs]
        ),
        "cached_fraction": cached / prompt_total if prompt_total else 0.0,
        "prompt_tokens": prompt_total,
        "cached_tokens": cached,
        "prefilled_tokens": sum(c["prefilled_tokens"] for c in cells),
        "peak_cache_bytes": [first["peak_cache_bytes"][s]],  # one entry per rank
        "median_decode_tps": _median([c["decode_tps"] for c in cells]),
        "max_overhead_fraction": max(
            (c["overhead_s"] / c["ttft_s"] for c in cells if c["ttft_s"] > 0), default=0.0
        ),
    }
    entry["evicted"] = sum(c["evicted"] for c in cells)
    if s in first["budget_peak_bytes"]:
        entry["budget_peak_bytes"] = [first["budget_peak_bytes"][s]]  # one entry per rank
        entry["budget_accounting"] = BUDGET_ACCOUNTING[s]
    if s == "carried":
        entry["resets"] = first["carried_resets"]
    if s == "exokv+disk":
        entry["spilled"] = sum(c["spilled"] for c in cells)
        entry["loaded_tokens"] = sum(c["loaded_tokens"] for c in cells)
    drift = [c["drift_tokens"] for c in cells if c.get("drift_tokens") is not None]
    if s in QUANTIZED and first.get("kv_bits"):
        entry["drifted_turns"] = len(drift)
        entry["drift_tokens"] = [c.get("drift_tokens") for c in cells]
    return entry


def _after_restart(turns: list[dict[str, Any]], restart_at: int) -> dict[str, Any]:
    """The turns from the restart on: what each strategy kept across it."""
    after = [t for t in turns if t["turn"] >= restart_at]
    return {
        "limit_ttft_s": sum(t["limit_ttft_s"] for t in after),
        **{
            s: {
                "ttft_s": sum(t["strategies"][s]["ttft_s"] for t in after),
                "cached_tokens": sum(t["strategies"][s]["cached_tokens"] for t in after),
            }
            for s in STRATEGIES
        },
    }


def _check_budget(summary: dict[str, Any], budget: int) -> None:
    """Per budgeted strategy: did what its policy bounds stay within the budget?

    Reported, not asserted. A turn over the budget is `unavoidable` when the
    policy could not have got below it (the turn's ``budget_floor_bytes``):
    mlx-lm-lru's active cache alone, or for exokv the entries the turn is served
    from (locked while in use, a partly matched one whole) plus its new tokens,
    is over the budget. Any other turn over it is a breach of the policy.
    """
    for s in BUDGETED:
        entry = summary["strategies"][s]
        if "budget_peak_bytes" not in entry:
            continue
        over, unavoidable = [], []
        for t in summary["turns"]:
            cell = t["strategies"][s]
            if (cell["budget_bytes"] or 0) > budget:
                floor = cell["budget_floor_bytes"] or 0
                (unavoidable if floor > budget else over).append(t["turn"])
        entry["within_budget"] = not over
        entry["over_budget_turns"] = over
        entry["unavoidably_over_budget_turns"] = unavoidable


WORKING_SET = (
    "distinct tokens of every sequence the scenario ran (prompts and generated replies, "
    "counted in a token trie) x bytes per token of exokv's cache on this rank: what a cache "
    "must hold to lose nothing (ideal_cache_bytes)"
)


def _against_working_set(summary: dict[str, Any], budget: int) -> None:
    """What share of the scenario's working set the budget holds, so a figure quoted as
    "a budget of a third of the working set" can be checked."""
    ideal = summary["ideal_cache_bytes"][0]
    summary["working_set_bytes"] = [ideal]
    summary["working_set"] = WORKING_SET
    summary["budget_bytes"] = budget
    summary["budget_fraction_of_working_set"] = [budget / ideal if ideal else 0.0]


def _loadavg() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:  # not on every platform
        return []


def _versions() -> dict[str, str]:
    out = {}
    for pkg in ("exokv", "mlx", "mlx-lm"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "unknown"
    return out


def on_progress(fn: Callable[[str], None]) -> Progress:
    """A Progress that calls `fn` with each description (for tests and scripts)."""

    class _P(Progress):
        def advance(self, description: str) -> None:
            fn(description)

    return _P()
