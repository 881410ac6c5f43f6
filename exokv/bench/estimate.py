"""How long `exokv bench` will take, said before its first measurement.

From the scenarios' sizes (each step's prompt, known from the plan before any reply)
and two rates measured on this machine right after the warm-up: one cold turn of a
prompt as long as the run's longest (capped), its prefill tokens/s and decode tokens/s.
Each step is measured once per strategy and once for the limit; the cold strategy
prefills the whole prompt, the others what their cache lacks: `PREFILLS_PER_STEP`
whole prompts a step on average (a builtin:tiny `--quick` run: the five strategies
prefilled 3.0 times the cold prompts' tokens, the limit a little more), plus fixed
costs (cache copies, the disk tier's writes). That run, on a machine whose load rose
from 11 to 19 as it went, was told 4 min and took 5.4: an estimate, not a promise.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from exokv.bench import STRATEGIES, scenarios

PREFILLS_PER_STEP = 3.2  # whole-prompt prefills a step costs, all strategies together
STEP_OVERHEAD_S = 0.02  # per measurement: copies and bookkeeping besides the model
MEASURED_PROMPT_MOST = 1024  # the rate probe's prompt, at most (a second or so)
MEASUREMENTS = len(STRATEGIES) + 1  # each strategy, and the limit
LONG_S = 120.0  # a run this long is told about --quick


@dataclass
class Rates:
    prefill_tps: float  # prompt tokens/s of a cold turn
    decode_tps: float  # reply tokens/s


def step_prompts(
    names: Sequence[str], turns: int, context: int, seed: int, render: Callable[..., list[int]]
) -> list[int]:
    """Each step's prompt tokens, about, scenario after scenario: a user turn's target;
    a retry or an edit, the turn before it (never longer)."""
    prompts: list[int] = []
    for name in names:
        last = 0
        for item in scenarios.build(name, turns, context, render, seed).plan:
            if item.action in ("user", "undo"):
                last = item.target
            prompts.append(last)
    return prompts


def seconds(prompts: Sequence[int], reply_tokens: int, repeat: int, rates: Rates) -> float:
    """The run's wall time, about, from its steps' prompts and the measured rates."""
    prefill = PREFILLS_PER_STEP * sum(prompts) / max(rates.prefill_tps, 1e-9)
    decode = MEASUREMENTS * len(prompts) * reply_tokens / max(rates.decode_tps, 1e-9)
    fixed = MEASUREMENTS * len(prompts) * STEP_OVERHEAD_S
    return repeat * (prefill + decode + fixed)


def measure(
    turn: Callable[[list[dict[str, str]], int], Any],
    render: Callable[..., list[int]],
    prompt_tokens: int,
    reply_tokens: int,
) -> Rates:
    """The rates of one cold turn (`turn(messages, max_tokens)` gives an Outcome) of
    about `prompt_tokens` (capped at MEASURED_PROMPT_MOST)."""
    target = max(32, min(prompt_tokens, MEASURED_PROMPT_MOST))
    text = scenarios.sized_text(random.Random(0), render, [], "user", target)
    tic = time.perf_counter()
    out = turn([{"role": "user", "content": text}], max(2, min(reply_tokens, 16)))
    took = time.perf_counter() - tic
    prefill = out.prompt_tokens / out.ttft_s if out.ttft_s > 0 else out.prompt_tokens / took
    return Rates(prefill, out.decode_tps or out.generated_tokens / max(took, 1e-9))


def say(total_s: float, steps: int, repeat: int, rates: Rates) -> str:
    """The line `exokv bench` prints on stderr before it starts."""
    runs = steps * repeat * MEASUREMENTS
    said = (
        f"about {_duration(total_s)} for {runs:,} measured turns (this machine, now: "
        f"{rates.prefill_tps:,.0f} prompt tok/s, {rates.decode_tps:,.0f} reply tok/s)"
    )
    return said + ("; --quick runs a short version" if total_s > LONG_S else "")


def _duration(s: float) -> str:
    if s < 90:
        return f"{max(1, round(s))} s"
    if s < 5400:
        return f"{round(s / 60)} min"
    return f"{s / 3600:.1f} h"
