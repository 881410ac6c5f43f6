"""Deterministic conversations for the benchmark, generated from a seed.

A scenario is a plan of steps over one or more conversations. The user messages
are sized against the real chat template and tokenizer so that the prompt of a
conversation's last turn reaches ``--context`` tokens. Because a user message is
sized from the history, and the history holds the model's (greedy, identical
for every strategy) replies, a step's messages are built only when it runs:
``next_step()`` gives the messages, ``commit()`` records the reply.

- ``linear``: one conversation, T turns.
- ``switch``: 4 conversations interleaved turn by turn, T turns each.
- ``branch``: one conversation of T turns with a ``/retry`` (halfway), an
  ``/undo`` (the next-to-last exchange is dropped and asked differently) and, at
  the end, an edit of an earlier user turn (the conversation forks there).
- ``restart``: switch, with every strategy started again (a new process) before
  the first turn of the second half (``Scenario.restart_at``).
- ``shared-prefix``: 8 conversations sharing one long system prompt (half the
  context), T turns each, interleaved (as many users of one assistant, each in
  a conversation of several turns: ``--turns`` is turns per conversation in
  every scenario).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from exokv.bench import SCENARIOS

Messages = list[dict[str, str]]
Render = Callable[[Sequence[dict[str, str]]], list[int]]

SWITCH_CONVERSATIONS = 4
SHARED_CONVERSATIONS = 8
MIN_WORDS = 3
# The smallest turn: a few words of user message, the template's tokens around it
# and a full reply. --context must give every turn at least this plus the reply.
MIN_TURN_OVERHEAD = 24

WORDS = (
    "the river moved slowly under a thin layer of fog farmer walked along bank with two "
    "dogs counting boats that passed she had lived in valley for forty years and knew "
    "every bend water when sun finally rose above hills lifted fields turned gold city "
    "people hurried to work carrying coffee checking their phones train was late again "
    "so teacher read book about history maps old were drawn by hand many them showed "
    "islands never existed sailors believed those real because said today we trust "
    "satellites but map is still story place computer stores numbers memory program "
    "tells it what do fast small disk large slow good uses both well together must agree "
    "on each one has seen window garden paper music winter orange signal harbor forest "
    "bridge candle thunder silver meadow lantern compass feather question answer please "
    "explain why how could would should might remember"
).split()


def min_turn_tokens(reply_tokens: int) -> int:
    """The fewest context tokens one turn needs: a short user message and a full reply."""
    return reply_tokens + MIN_TURN_OVERHEAD


@dataclass
class PlanItem:
    conversation: str
    action: str  # user | retry | undo | edit
    target: int = 0  # prompt tokens this turn should reach (user, undo)
    edit_turn: int = 0  # which user turn (1-based) an edit replaces


@dataclass
class Step:
    """One model turn: the whole prompt of one conversation at this point."""

    index: int  # 1-based, across the scenario
    conversation: str
    action: str
    messages: Messages


@dataclass
class Scenario:
    name: str
    plan: list[PlanItem]
    render: Render
    seed: int
    histories: dict[str, Messages] = field(default_factory=dict)
    restart_at: int | None = None  # the step (1-based) a new process runs first
    position: int = 0
    _pending: tuple[Step, Messages] | None = None

    def __len__(self) -> int:
        return len(self.plan)

    def next_step(self) -> Step | None:
        if self.position >= len(self.plan):
            return None
        item = self.plan[self.position]
        self.position += 1
        history = self.histories[item.conversation]
        rng = random.Random(f"{self.seed}:{self.name}:{item.conversation}:{self.position}")
        if item.action == "user":
            base = list(history)
            messages = base + [self._user(rng, base, item.target)]
        elif item.action == "retry":
            if history[-1]["role"] != "assistant":
                raise ValueError("retry needs a reply to regenerate")
            messages = history[:-1]
        elif item.action == "undo":
            base = history[:-2]
            messages = base + [self._user(rng, base, item.target)]
        elif item.action == "edit":
            idx = _user_index(history, item.edit_turn)
            base = history[:idx]
            target = len(self.render(history[: idx + 1]))
            messages = base + [self._user(rng, base, target)]
        else:
            raise ValueError(f"unknown action {item.action}")
        step = Step(self.position, item.conversation, item.action, messages)
        self._pending = (step, messages)
        return step

    def commit(self, step: Step, reply: str) -> None:
        """Record the reply of the step just run: it joins that conversation's history."""
        if self._pending is None or self._pending[0] is not step:
            raise ValueError("commit the step that next_step() returned")
        self.histories[step.conversation] = list(step.messages) + [
            {"role": "assistant", "content": reply}
        ]
        self._pending = None

    def _user(self, rng: random.Random, base: Messages, target: int) -> dict[str, str]:
        return {"role": "user", "content": sized_text(rng, self.render, base, "user", target)}


def sized_text(rng: random.Random, render: Render, base: Messages, role: str, target: int) -> str:
    """Words for one message of `role` such that render(base + [it]) is about `target` tokens.

    The most words whose rendered prompt stays within `target`, and at least
    MIN_WORDS (a prompt already past the target grows by a short message).
    """
    words = [rng.choice(WORDS) for _ in range(max(MIN_WORDS, target) + 8)]

    def size(n: int) -> int:
        return len(render(base + [{"role": role, "content": " ".join(words[:n])}]))

    lo, hi = MIN_WORDS, len(words)
    if size(lo) >= target:
        return " ".join(words[:lo])
    while lo < hi:  # the largest n with size(n) <= target
        mid = (lo + hi + 1) // 2
        if size(mid) <= target:
            lo = mid
        else:
            hi = mid - 1
    return " ".join(words[:lo])


def build(name: str, turns: int, context: int, render: Render, seed: int = 0) -> Scenario:
    """The scenario `name` for T turns (per conversation) reaching `context` tokens."""
    if name not in SCENARIOS:
        raise ValueError(f"unknown scenario {name}")

    def target(t: int, n: int, start: int = 0) -> int:
        return start + round((context - start) * t / n)

    histories: dict[str, Messages] = {}
    plan: list[PlanItem] = []
    if name == "linear":
        histories["linear"] = [_system("You are a helpful assistant. Answer briefly.")]
        plan = [PlanItem("linear", "user", target(t, turns)) for t in range(1, turns + 1)]
    elif name in ("switch", "restart"):
        convs = [f"chat{c + 1}" for c in range(SWITCH_CONVERSATIONS)]
        topics = ("maps", "rivers", "memory", "music")
        for conv, topic in zip(convs, topics, strict=True):
            histories[conv] = [_system(f"You are a helpful assistant who knows about {topic}.")]
        plan = [
            PlanItem(conv, "user", target(t, turns)) for t in range(1, turns + 1) for conv in convs
        ]
    elif name == "branch":
        histories["branch"] = [_system("You are a careful assistant. Think before answering.")]
        retry_after = max(1, turns // 2)
        for t in range(1, turns + 1):
            if t == turns and turns >= 2:
                # /undo the exchange before the last one and ask it differently.
                plan.append(PlanItem("branch", "undo", target(t - 1, turns)))
            plan.append(PlanItem("branch", "user", target(t, turns)))
            if t == retry_after:
                plan.append(PlanItem("branch", "retry"))
        plan.append(PlanItem("branch", "edit", edit_turn=max(1, min(2, turns - 1))))
    else:  # shared-prefix
        rng = random.Random(f"{seed}:{name}:system")
        system = sized_text(rng, render, [], "system", context // 2)
        system = "You are the assistant of a library. The rules follow. " + system
        start = len(render([_system(system)]))
        convs = [f"user{c + 1}" for c in range(SHARED_CONVERSATIONS)]
        for conv in convs:
            histories[conv] = [_system(system)]
        plan = [
            PlanItem(conv, "user", target(t, turns, start))
            for t in range(1, turns + 1)
            for conv in convs
        ]
    scen = Scenario(name=name, plan=plan, render=render, seed=seed, histories=histories)
    if name == "restart":
        scen.restart_at = SWITCH_CONVERSATIONS * (turns // 2) + 1 if turns > 1 else None
    return scen


def _system(text: str) -> dict[str, str]:
    return {"role": "system", "content": text}


def _user_index(history: Messages, turn: int) -> int:
    seen = 0
    for i, m in enumerate(history):
        if m["role"] == "user":
            seen += 1
            if seen == turn:
                return i
    raise ValueError(f"the conversation has no user turn {turn}")
