"""Wire one `exokv chat` invocation: options -> client -> controller -> script or REPL."""

from __future__ import annotations

import sys

from exokv.chat.conversation import ChatController, ChatHooks, TurnSettings
from exokv.chat.script import run_one, run_script
from exokv.core.options import ClusterOptions
from exokv.frontend.hooks import StoreHooks, stderr_warning
from exokv.frontend.signals import ended_by_signals
from exokv.frontend.start import ChatOptions, prepare, started, store_hooks
from exokv.hosts.placement import Plan
from exokv.hosts.plan import plan_event, print_plan


def interactive(opts: ChatOptions) -> bool:
    """The REPL needs a terminal to read from and one to draw the prompt on."""
    if opts.json or opts.prompt is not None or not sys.stdin.isatty():
        return False
    return sys.stdout.isatty() or sys.stderr.isatty()


def run_chat(opts: ChatOptions, hooks: ChatHooks | None = None) -> int:
    """Open the store, start the ranks, run the REPL or script mode, save and close.

    Every finished turn is written to the store as it ends; on /quit, Ctrl-D or the
    end of standard input the current session's KV cache is saved too. An exception
    or a third Ctrl-C skips that save (the conversation itself is already stored),
    and so do SIGTERM and SIGHUP, which end the chat as an error would: the ranks
    still shut down cleanly and keep their KV cache in the disk tier.
    """
    cluster, plan = prepare(opts)
    if opts.plan:
        return print_plan(plan, opts.json)
    with ended_by_signals():
        return _run_chat(opts, cluster, hooks, plan)


def _run_chat(
    opts: ChatOptions, cluster: ClusterOptions, hooks: ChatHooks | None, plan: Plan | None = None
) -> int:
    with started(opts, cluster) as run:
        client = run.client
        if hooks is None:
            hooks = store_hooks(run, opts)
        settings = TurnSettings(
            max_tokens=opts.max_tokens,
            temp=opts.temp,
            seed=opts.seed,
            use_cache=cluster.keep_cache,
            speculate=not opts.no_speculate,
        )
        chat = ChatController(client, settings, opts.session, opts.system, hooks)
        if interactive(opts):
            # deferred: prompt-toolkit (0.2 s) only for the REPL, not for script mode
            from exokv.chat.repl import run_repl

            # it saves when the user leaves
            return run_repl(
                chat, client, cluster, typeahead=not opts.no_typeahead, plain=opts.plain
            )
        if isinstance(hooks, StoreHooks):
            hooks.attach(warn=stderr_warning)
        first = [plan_event(plan)] if plan is not None else []  # the first turn's events
        if opts.prompt is not None:
            code = run_one(chat, opts.prompt, opts.json, first)
        else:
            code = run_script(chat, opts.json, first_events=first)
        if isinstance(hooks, StoreHooks):
            hooks.finish(chat)
        return code
