"""Wire one `exokv serve`: options -> the chat's client and store -> the turn queue ->
the Starlette app under uvicorn; on SIGTERM or Ctrl-C, drain and shut down like /quit."""

from __future__ import annotations

import functools
import ipaddress
import re
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from exokv.chat.conversation import Conversation
from exokv.client.heal import HealingClient
from exokv.errors import ExokvError, UsageError
from exokv.frontend.signals import ended_by_signals
from exokv.frontend.start import ChatOptions, Started, prepare, started, store_hooks
from exokv.hosts.plan import print_plan
from exokv.prompt.markers import PREFIX
from exokv.serve import api
from exokv.serve.app import Service, build_app
from exokv.serve.prompts import FrontRender
from exokv.serve.replies import RepliesFromStore
from exokv.serve.rows import default_batch
from exokv.serve.tools import model_tools
from exokv.serve.work import TurnQueue

if TYPE_CHECKING:
    from exokv.serve.drain import DrainingServer

DEFAULT_PORT = 8000
# How long a batch's first request waits for others sent with it (docs/serve-batching.md).
DEFAULT_BATCH_WAIT_MS = 10.0
ORIGIN = re.compile(r"[a-z][a-z0-9+.-]*://[^/\s]+")  # what a browser's Origin header holds


@dataclass
class ServeOptions:
    """`exokv serve`'s options: the chat's model, layout and cache, as the chat has them
    (`front`: what `prepare` and `started` take), and the server's own."""

    front: ChatOptions  # the chat's own flags (--session, --json, ...) at their defaults
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    api_key: str | None = None
    queue: int = 64  # requests waiting for the ranks; more get 503
    drain_s: float = 30.0  # on SIGTERM/Ctrl-C, how long in-flight requests may take
    max_body: int = api.Limits.body_bytes
    # Requests decoded together at most (1: one at a time); None: as many as the ranks'
    # memory holds, at least 32 where it can (exokv.serve.rows), once they have started.
    batch: int | None = None
    batch_wait_ms: float = DEFAULT_BATCH_WAIT_MS  # a batch's first request waits for more
    allow_origins: tuple[str, ...] = ()  # --allow-origin: browser pages' origins (CORS)


def check(opts: ServeOptions) -> list[str]:
    """Bounds of the server's own options (usage errors, after `validate`'s); returns
    warnings to print."""
    if not 0 <= opts.port <= 65535:
        raise UsageError(f"--port {opts.port}: use 0-65535 (0: any free port)")
    if opts.queue < 1:
        raise UsageError(f"--queue {opts.queue}: at least 1")
    if opts.batch is not None and opts.batch < 1:
        raise UsageError(f"--batch {opts.batch}: at least 1 (1: one request at a time)")
    if not 0 <= opts.batch_wait_ms <= 1000:
        raise UsageError(f"--batch-wait {opts.batch_wait_ms}: 0-1000 ms (0: no wait)")
    if opts.drain_s < 0:
        raise UsageError(f"--drain-timeout {opts.drain_s}: 0 or more seconds")
    if opts.api_key is not None and not opts.api_key.strip():
        raise UsageError("--api-key is empty")
    for origin in opts.allow_origins:
        if origin != "*" and not ORIGIN.fullmatch(origin):
            raise UsageError(
                f"--allow-origin {origin!r}: an origin is '*' or scheme://host[:port], "
                "as a browser sends it (no path, no trailing slash)"
            )
    if not _loopback(opts.host) and opts.api_key is None:
        return [
            f"serving on {opts.host} without --api-key: anyone who can reach this port can "
            "use the model, and requests and replies cross the network in clear (no TLS)"
        ]
    return []


def origins(values: list[str] | None) -> tuple[str, ...]:
    """--allow-origin's values, each one origin or a comma-separated list of them."""
    return tuple(o.strip() for v in values or [] for o in v.split(",") if o.strip())


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def model_names(model: str) -> tuple[str, set[str]]:
    """The id the API shows for the loaded model, and every name that selects it.

    A local path is shown by its last component (the API does not tell the network
    where the files are); the names only ever select the loaded model.
    """
    shown = Path(model).name if ("/" in model and Path(model).exists()) else model
    return shown, {shown, model}


def _say(text: str) -> None:
    print(f"exokv: {text}", file=sys.stderr, flush=True)


class _Recorder:
    """Every turn the server ran, into the store as the chat records its turns: the
    conversation (under its `api-` session), the cache's events, entries and samples —
    what `exokv cache stats|entries|pressure` read while the server runs."""

    def __init__(self, hooks: Any) -> None:
        self.hooks = hooks

    def __call__(self, job: Any) -> None:
        request, result = job.request, job.result
        messages = [dict(m) for m in request.messages]
        system = messages.pop(0)["content"] if messages[0]["role"] == "system" else None
        reply = job.reply
        if messages[-1]["role"] == PREFIX:  # a forced call: its opening is the reply's start
            reply = messages.pop()["content"] + reply
        if reply:
            messages.append({"role": "assistant", "content": reply})
        if job.cancelled.is_set():
            # The client left and never saw this reply: its turn (events, figures) is
            # recorded, the conversation is not. The call it sends instead may end first:
            # a late partial reply would then replace that one's, and the next call would
            # find no tokens for the reply it really holds.
            messages = []
        self.hooks.turn_done(Conversation(request.session, system, messages), result)
        self.hooks.forget(request.session)  # the next call brings the whole conversation


def run_serve(opts: ServeOptions) -> int:
    """Start the ranks, serve until SIGTERM, Ctrl-C or the ranks' end, drain; exit code."""
    front = opts.front
    cluster, plan = prepare(front)
    if front.plan:
        return print_plan(plan, False)
    for warning in check(opts):
        _say(f"warning: {warning}")
    with ended_by_signals(), started(front, cluster, kind="serve") as run:
        return _serve(opts, run)


def _serve(opts: ServeOptions, run: Started) -> int:
    """The turn queue on the started ranks, the app under uvicorn, until it stops."""
    # Replies' tokens a restart forgot come back from the store (exokv.serve.replies).
    client = RepliesFromStore(run.client, run.store.load_reply_tokens)
    if isinstance(run.client, HealingClient):
        run.client.heal_when_idle = True  # /health says so; no request waits for it
    # No session locks: an API conversation is not opened like a chat's session.
    hooks = store_hooks(run, opts.front, locks=False)
    failed: list[str] = []
    server: DrainingServer | None = None

    def on_failure(why: str) -> None:
        failed.append(why)
        if server is not None:
            server.should_exit = True

    queue = TurnQueue(
        client,
        opts.queue,
        record=_Recorder(hooks),
        on_failure=on_failure,
        batch=_batch(opts, run.client),
        gather_s=opts.batch_wait_ms / 1000,
    )
    service = _service(opts, run, client, queue, failed)
    server = _server(opts, service, queue)
    _watch_ranks(service, server)
    try:
        server.run()
    finally:
        # Normally done by the drain; after a failure, what is left is stopped here.
        queue.close(timeout=0.0 if service.failure() else 2.0)
    return _ended(service, server)


def _batch(opts: ServeOptions, client: Any) -> int:
    """--batch, or the rows the started ranks' memory holds (said in one line)."""
    if opts.batch is not None:
        return opts.batch
    rows = default_batch(
        client.budgets,
        client.kv_per_token,
        client.model_context,
        opts.front.max_tokens,
        opts.queue,
    )
    _say(f"decoding up to {rows} requests together (--batch: what memory holds)")
    return rows


def _service(
    opts: ServeOptions, run: Started, client: Any, queue: TurnQueue, failed: list[str]
) -> Service:
    """What the app's handlers serve: the model's names, the queue, the limits, the
    defaults, and where a failure is read (`failed`: the queue's)."""
    front, cluster = opts.front, run.cluster
    shown, names = model_names(front.model)
    return Service(
        model=shown,
        names=names,
        queue=queue,
        ranks=client.ranks,
        api_key=opts.api_key,
        limits=api.Limits(body_bytes=opts.max_body),
        defaults=api.Defaults(
            max_tokens=front.max_tokens, temperature=front.temp, system=front.system
        ),
        use_cache=cluster.keep_cache,
        speculate=not front.no_speculate,
        allow_origins=list(opts.allow_origins),
        log=lambda line: print(line, file=sys.stderr, flush=True),
        failure=lambda: client.failure or (failed[0] if failed else None),
        health=run.client.health,
        tools=functools.cache(lambda: model_tools(front.model, cluster.chat_template)),
        count=FrontRender(front.model, cluster.chat_template, client.known).count,
    )


def _server(opts: ServeOptions, service: Service, queue: TurnQueue) -> DrainingServer:
    """uvicorn serving the app, draining in-flight requests on SIGTERM/Ctrl-C."""
    # deferred: uvicorn (0.13 s) only once the ranks are up, not for `serve --plan` nor
    # for what imports this module (the front end's check in tests/test_layers.py)
    import uvicorn

    # deferred, as uvicorn: they import it
    from exokv.serve import connections
    from exokv.serve.drain import AFTER_STOP_S, DrainingServer

    def halt() -> None:
        # The drain limit passed (or nothing runs): what is left is stopped on every
        # rank and each stream then ends with its own last chunk.
        service.halted = service.in_flight() > 0
        queue.close(timeout=0.0)

    config = uvicorn.Config(
        build_app(service),
        host=opts.host,
        port=opts.port,
        log_level="warning",
        access_log=False,  # ours has the tokens, the cached share and the TTFT
        timeout_graceful_shutdown=AFTER_STOP_S,  # after exokv's own drain
        lifespan="off",
        # Read deadlines and a cap on open connections (exokv.serve.connections).
        http=connections.guarded_protocol(connections.Guard(connections.Notices(_say))),
        backlog=connections.BACKLOG,
    )
    connections.hold_logs_to_pace()  # after Config, which sets uvicorn's loggers up
    return DrainingServer(
        config,
        drain_s=opts.drain_s,
        busy=service.in_flight,
        halt=halt,
        say=lambda text: _say(text),
    )


def _ended(service: Service, server: DrainingServer) -> int:
    """The exit code, and what the server's end says on stderr; the ranks' failure raises."""
    why = service.failure()
    if why:  # the ranks are gone: one line, exit 1, as the chat
        raise ExokvError(why)
    if server.stopped:
        _say(f"stopped {server.stopped} request(s) at the drain limit")
    if server.signal == signal.SIGINT:
        _say("interrupted")
    return server.exit_code


def _watch_ranks(service: Any, server: Any) -> None:
    """End the server when the ranks are gone (ClusterClient notices it between requests;
    its wake-up signal would raise in the middle of the event loop, so it is replaced)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGUSR1, lambda *_: None)

    def watch() -> None:
        while not server.started and not server.should_exit:
            time.sleep(0.05)
        if server.started:
            host, port = server.servers[0].sockets[0].getsockname()[:2]
            where = f"[{host}]" if ":" in host else host
            noun = "rank" if service.ranks == 1 else "ranks"
            _say(
                f"serving {service.model} on {service.ranks} {noun} at http://{where}:{port}/v1 "
                "(Ctrl-C to stop)"
            )
        while not server.should_exit:
            if service.failure():
                server.should_exit = True
                return
            time.sleep(0.5)

    threading.Thread(target=watch, name="exokv-serve-watch", daemon=True).start()
