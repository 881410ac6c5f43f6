"""Wire one `exokv chat` invocation: options -> client -> controller -> script or REPL."""

from __future__ import annotations

import sys
from dataclasses import dataclass

from exokv.chat.conversation import ChatController, ChatHooks, TurnSettings
from exokv.config import parse_budgets
from exokv.engine import EngineOptions
from exokv.errors import UsageError


@dataclass
class ChatOptions:
    model: str
    system: str | None = None
    max_tokens: int = 256
    temp: float = 0.0
    seed: int | None = None
    ranks: int = 1
    hosts: str | None = None
    hostfile: str | None = None
    backend: str = "ring"
    parallel: str = "pipeline"
    split: str | None = None
    cache_budget: str | None = None
    memory_threshold: float = 0.9
    max_kv_size: int | None = None
    no_cache: bool = False
    session: str | None = None
    json: bool = False
    starting_port: int | None = None

    def rank_count(self) -> int:
        if self.hosts:
            return len([h for h in self.hosts.split(",") if h.strip()])
        return self.ranks


def validate(opts: ChatOptions) -> None:
    if opts.max_tokens < 1:
        raise UsageError("--max-tokens must be at least 1")
    if opts.temp < 0:
        raise UsageError("--temp must be 0 or more")
    if not 0 < opts.memory_threshold <= 1:
        raise UsageError("--memory-threshold must be a fraction in (0, 1]")
    if opts.ranks < 1:
        raise UsageError("--ranks must be at least 1")
    parse_budgets(opts.cache_budget, opts.rank_count())


def make_client(opts: ChatOptions):  # noqa: ANN201 - LocalClient or ClusterClient
    budgets = parse_budgets(opts.cache_budget, opts.rank_count())
    if opts.rank_count() == 1 and not opts.hostfile:
        from exokv.chat.local import LocalClient

        return LocalClient(
            opts.model,
            EngineOptions(
                budget=budgets[0] if budgets else None,
                memory_threshold=opts.memory_threshold,
                max_kv_size=opts.max_kv_size,
                seed=opts.seed,
            ),
        )
    from exokv.cluster.client import ClusterClient

    return ClusterClient(opts, budgets)


def run_chat(opts: ChatOptions, hooks: ChatHooks | None = None) -> int:
    validate(opts)
    client = make_client(opts)
    try:
        settings = TurnSettings(
            max_tokens=opts.max_tokens,
            temp=opts.temp,
            seed=opts.seed,
            use_cache=not opts.no_cache,
        )
        chat = ChatController(client, settings, opts.session, opts.system, hooks)
        if sys.stdin.isatty() and not opts.json:
            from exokv.chat.repl import run_repl

            return run_repl(chat, client, opts)
        from exokv.chat.script import run_script

        return run_script(chat, opts.json)
    finally:
        client.close()
