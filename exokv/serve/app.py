"""The Starlette application: the API routes over the one turn queue.

POST /v1/chat/completions (OpenAI chat), POST /v1/completions (a prompt in, text
out), POST /v1/messages (Anthropic's Messages API) and /v1/messages/count_tokens (its
prompt's tokens, no turn), GET /v1/models, GET /metrics (Prometheus), GET /health.
Each API only reads its request into a `TurnRequest` and writes the turn's events in
its own shape (a `Shape`); the job, its queue, its stream, its keep-alives, its
disconnect and its access line are the same for all.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from exokv.core.records import TurnRequest, TurnResult
from exokv.serve import anthropic, api, completions
from exokv.serve.metrics import Metrics
from exokv.serve.tools import ModelTools
from exokv.serve.work import Job, TurnQueue

DISCONNECT_POLL_S = 0.25  # how often a waiting request checks that its client is still there
DRAIN_BYTES = 16 << 20  # of a body over the limit, read and dropped so the 413 arrives
# A stream's headers wait this long for the turn's first event (so a refused prompt
# is still a 400); a longer prefill is streamed with keep-alive comments meanwhile.
HEAD_WAIT_S = 1.0
KEEPALIVE_S = 5.0  # between two SSE comments while nothing else is sent
KEEPALIVE = b": keep-alive\n\n"
SHUT_DOWN = "the server shut down before the reply was complete"


@dataclass
class Service:
    """What the routes need: the model's names, the queue, the key, the limits, the log."""

    model: str  # the id /v1/models shows
    names: set[str]  # what a request's model field may say
    queue: TurnQueue
    ranks: int
    api_key: str | None = None
    limits: api.Limits = field(default_factory=api.Limits)
    defaults: api.Defaults = field(default_factory=api.Defaults)
    use_cache: bool = True
    speculate: bool = True  # drafts checked by the model (off: --no-speculate)
    log: Callable[[str], None] = print
    failure: Callable[[], str | None] = lambda: None
    # The ranks down or starting again (a healing client), in words; None when ready.
    health: Callable[[], str | None] = lambda: None
    metrics: Metrics = field(default_factory=Metrics)
    # The model's tool calling (exokv.serve.tools.ModelTools), read when first asked for.
    tools: Callable[[], ModelTools | None] = lambda: None
    # A turn's prompt tokens, rendered as its ranks would (exokv.serve.prompts); None:
    # this server cannot count them.
    count: Callable[[TurnRequest], int] | None = None
    open: int = 0  # requests with a job not answered yet (the drain counts them)
    halted: bool = False  # the drain limit passed: what still runs was stopped

    def in_flight(self) -> int:
        return max(self.open, int(self.queue.busy) + self.queue.waiting)


class Shape(Protocol):
    """One API's request read and reply written (api.ChatShape, completions, anthropic)."""

    stream: bool

    def error_doc(self, err: api.ApiError) -> dict[str, Any]: ...

    def whole(self, job: Job, result: TurnResult) -> dict[str, Any]: ...

    def opening(self) -> list[bytes]: ...

    def piece(self, text: str) -> list[bytes]: ...

    def closing(self, job: Job, result: TurnResult) -> list[bytes]: ...

    def broken(self, err: api.ApiError, job: Job) -> list[bytes]:
        """A stream that cannot finish: an error event, its end, then the stream's end."""
        ...


class Disconnected(Exception):
    """The client went away before its reply was complete."""


class _Request:
    """One request's log line: time, route, status, tokens, cached, TTFT, duration."""

    def __init__(self, service: Service, request: Request) -> None:
        self.service = service
        self.started = time.perf_counter()
        client = request.client
        self.peer = f"{client.host}:{client.port}" if client else "-"
        self.route = f"{request.method} {request.url.path}"
        self.counted = False  # in service.open until written

    def opened(self) -> None:
        self.counted = True
        self.service.open += 1

    def write(self, status: int, job: Job | None = None, stream: bool = False) -> None:
        if self.counted:
            self.counted = False
            self.service.open -= 1
        parts = [
            time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime()),
            self.peer,
            self.route,
            str(status),
        ]
        result = job.result if job is not None else None
        if result is not None:
            parts += [
                f"prompt={result.prompt_tokens}",
                f"cached={result.cached_tokens}",
                f"completion={result.generated_tokens}",
                f"finish={result.finish_reason}",
            ]
            if result.speculation == "off":
                parts.append("speculation=off")
            elif result.draft_tokens:
                parts.append(f"drafts={result.accepted_tokens}/{result.draft_tokens}")
        if job is not None and job.ttft_s is not None:
            parts.append(f"ttft={job.ttft_s:.3f}s")
        if job is not None and job.batch > 1:
            parts.append(f"batch={job.batch}")  # decoded together with batch-1 others
        parts.append(f"time={time.perf_counter() - self.started:.3f}s")
        if stream:
            parts.append("stream")
        self.service.log(" ".join(parts))
        self.service.metrics.answered(self.route, status, job)


def _check_key(service: Service, request: Request) -> None:
    if service.api_key is None:
        return
    given = request.headers.get("authorization", "")
    scheme, _, key = given.partition(" ")
    if scheme.lower() != "bearer":  # Anthropic's clients send their key as x-api-key
        scheme, key = "bearer", request.headers.get("x-api-key", "")
    if not hmac.compare_digest(key.strip().encode(), service.api_key.encode()):
        raise api.ApiError(
            401,
            "missing or wrong API key: send 'Authorization: Bearer KEY' (or 'x-api-key: KEY')",
            code="invalid_api_key",
        )


async def _body(request: Request, limit: int) -> bytes:
    """The request body, or 413 once it is over `limit` bytes.

    What comes over the limit is read and dropped (up to DRAIN_BYTES more, then the
    connection is given up on): a client still sending when the answer came would see
    its connection reset instead of the 413.
    """
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size <= limit:
            chunks.append(chunk)
        elif size > limit + DRAIN_BYTES:
            break
    if size > limit:
        raise api.ApiError(413, f"the request body is over {limit:,} bytes", code="too_large")
    return b"".join(chunks)


async def _next_event(
    job: Job, request: Request, within: float | None = None
) -> tuple[str, Any] | None:
    """The job's next event; Disconnected (the job cancelled) if the client leaves first;
    None if `within` seconds pass first."""
    deadline = None if within is None else time.monotonic() + within
    while True:
        wait = DISCONNECT_POLL_S
        if deadline is not None:
            wait = min(wait, deadline - time.monotonic())
            if wait <= 0:
                return None
        try:
            return await asyncio.wait_for(job.events.get(), wait)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                raise Disconnected from None


class _Stream(StreamingResponse):
    """Server-sent events that, however they end, say so: a client that disconnects
    cancels the stream (Starlette listens for it), and `on_close` then stops the job."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        super().__init__(
            content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )
        self.on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        except OSError:
            pass  # the client's connection broke mid-write: it left, on_close says so
        finally:
            self.on_close()


# A request's body read into its turn, the stops its reply is cut at, and its shape.
Parse = Callable[[Service, bytes], tuple[TurnRequest, list[str], Shape]]
Handler = Callable[[Service, Request], Awaitable[Response]]
ErrorDoc = Callable[[api.ApiError], dict[str, Any]]  # an error in one API's shape


def build_app(service: Service) -> Starlette:
    """The application: each route's handler, and the one for unknown routes, bound to
    `service`."""

    def bound(handler: Handler) -> Callable[[Request], Awaitable[Response]]:
        # A function of its own: Starlette calls a function with the request, but takes
        # anything else (the partial of `turns`) for an ASGI app.
        async def endpoint(request: Request) -> Response:
            return await handler(service, request)

        return endpoint

    def turns(parse: Parse, error_doc: ErrorDoc) -> Callable[[Request], Awaitable[Response]]:
        return bound(functools.partial(_call, parse=parse, error_doc=error_doc))

    async def not_found(request: Request, exc: HTTPException) -> Response:
        return _not_found(service, request, exc)

    return Starlette(
        routes=[
            Route("/health", bound(_health), methods=["GET"]),
            Route("/metrics", bound(_metrics), methods=["GET"]),
            Route("/v1/models", bound(_models), methods=["GET"]),
            Route("/v1/chat/completions", turns(_chat, api.ApiError.doc), methods=["POST"]),
            Route("/v1/completions", turns(_complete, api.ApiError.doc), methods=["POST"]),
            Route("/v1/messages", turns(_messages, anthropic.error_doc), methods=["POST"]),
            Route("/v1/messages/count_tokens", bound(_count_tokens), methods=["POST"]),
        ],
        exception_handlers={HTTPException: not_found},
    )


async def _health(service: Service, request: Request) -> Response:
    failure = service.failure()
    trouble = failure or service.health()
    status = "failed" if failure else ("ok" if trouble is None else "degraded")
    doc = {
        "status": status,
        "model": service.model,
        "ranks": service.ranks,
        "waiting": service.queue.waiting,
        "busy": service.queue.busy,
    }
    if trouble:
        doc["error"] = trouble
    return JSONResponse(doc, status_code=200 if trouble is None else 503)


async def _models(service: Service, request: Request) -> Response:
    log = _Request(service, request)
    try:
        _check_key(service, request)
    except api.ApiError as err:
        log.write(err.status)
        return _refusal(err)
    log.write(200)
    entry = {"id": service.model, "object": "model", "created": 0, "owned_by": "exokv"}
    return JSONResponse({"object": "list", "data": [entry]})


async def _metrics(service: Service, request: Request) -> Response:
    try:
        _check_key(service, request)
    except api.ApiError as err:
        return _refusal(err)
    text = service.metrics.render(service.queue.waiting, service.in_flight())
    return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")


def _model_tools(service: Service, call: api.ChatCall) -> ModelTools | None:
    """The model's tool calling, read only for a request that has tools in it."""
    return service.tools() if call.tools or call.tool_messages else None


def _chat(service: Service, body: bytes) -> tuple[TurnRequest, list[str], Shape]:
    call = api.parse_chat(body, service.names, service.defaults, service.limits)
    shape = api.ChatShape(service.model, call, _model_tools(service, call))
    return _turn(service, call, shape.turn_messages()), call.stop, shape


def _complete(service: Service, body: bytes) -> tuple[TurnRequest, list[str], Shape]:
    call = completions.parse(body, service.names, service.defaults, service.limits)
    return _turn(service, call), call.stop, completions.Shape(service.model, call)


def _messages(
    service: Service, body: bytes, counting: bool = False
) -> tuple[TurnRequest, list[str], Shape]:
    """An Anthropic request's turn; `counting`: for count_tokens (no max_tokens)."""
    call = anthropic.parse(body, service.names, service.defaults, service.limits, counting)
    shape = anthropic.Shape(service.model, call, _model_tools(service, call))
    return _turn(service, call, shape.turn_messages()), call.stop, shape


async def _count_tokens(service: Service, request: Request) -> Response:
    log = _Request(service, request)
    try:
        _check_key(service, request)
        body = await _body(request, service.limits.body_bytes)
        turn, _, _ = _messages(service, body, counting=True)
        if service.count is None:
            raise api.ApiError(404, "this server does not count tokens")
        # Rendering a long conversation takes a while: not in the event loop.
        count = await asyncio.to_thread(service.count, turn)
    except api.ApiError as err:
        log.write(err.status)
        return _refusal(err, anthropic.error_doc)
    except ClientDisconnect:
        log.write(499)
        return Response(status_code=499)
    log.write(200)
    return JSONResponse({"input_tokens": count})


def _not_found(service: Service, request: Request, exc: HTTPException) -> Response:
    err = api.ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}")
    _Request(service, request).write(exc.status_code)
    return _refusal(err)


def _refusal(err: api.ApiError, error_doc: ErrorDoc = api.ApiError.doc) -> Response:
    """`err` answered in its API's shape (OpenAI's unless told), with its headers."""
    return JSONResponse(error_doc(err), status_code=err.status, headers=err.headers)


def _turn(service: Service, call: Any, messages: list[dict[str, Any]] | None = None) -> TurnRequest:
    """The turn a checked call asks for (every API's call has these fields); `messages`:
    the call's with their markers (tools, a forced call's opening), if it has any."""
    messages = call.messages if messages is None else messages
    return TurnRequest(
        session=api.conversation_name(messages),
        messages=messages,
        max_tokens=call.max_tokens,
        temp=call.temperature,
        use_cache=service.use_cache,
        speculate=service.speculate,
        top_p=call.top_p,
        sample_seed=call.seed,
        grammar=call.grammar,
        logprobs=call.logprobs,
    )


async def _call(
    service: Service,
    request: Request,
    parse: Parse,
    error_doc: ErrorDoc,
) -> Response:
    log = _Request(service, request)
    job: Job | None = None
    shape: Shape | None = None

    def refused(err: api.ApiError) -> Response:
        log.write(err.status, job)
        return _refusal(err, error_doc)

    try:
        _check_key(service, request)
        body = await _body(request, service.limits.body_bytes)
        turn, stops, shape = parse(service, body)
        job = Job(turn, stops, asyncio.get_running_loop())
        service.queue.submit(job)
        log.opened()
        service.metrics.queued(job)
        # Errors (a prompt too long) come before the headers; a stream waits only so long.
        first = await _next_event(job, request, HEAD_WAIT_S if shape.stream else None)
        if first is not None and first[0] == "error":
            raise first[1]
    except api.ApiError as err:
        return refused(err)
    except (Disconnected, ClientDisconnect):
        if job is None:
            log.write(499)
        else:
            service.queue.cancel(job)
            _log_when_over(log, job)
        return Response(status_code=499)
    if shape.stream:
        return _stream(service, log, job, shape, first)
    return await _whole(service, log, job, request, first, shape, refused)


_draining: set[asyncio.Task[None]] = set()  # log lines waiting for their stopped turns


def _log_when_over(log: _Request, job: Job, stream: bool = False) -> None:
    """A request whose client left: its line once the ranks have ended its turn, so it
    says how far the turn went (finish=interrupted, the tokens made before the stop)."""

    async def wait() -> None:
        while (await job.events.get())[0] == "text":
            pass
        log.write(499, job, stream=stream)

    task = asyncio.get_running_loop().create_task(wait())
    _draining.add(task)
    task.add_done_callback(_draining.discard)


def _cut_by_drain(service: Service, result: TurnResult) -> bool:
    return service.halted and result.finish_reason == "interrupted"


async def _whole(
    service: Service,
    log: _Request,
    job: Job,
    request: Request,
    event: tuple[str, Any] | None,
    shape: Shape,
    refused: Callable[[api.ApiError], Response],
) -> Response:
    try:
        while event is None or event[0] == "text":
            event = await _next_event(job, request)
    except Disconnected:
        service.queue.cancel(job)
        _log_when_over(log, job)
        return Response(status_code=499)
    if event[0] == "error":
        return refused(event[1])
    result = event[1]
    if _cut_by_drain(service, result):
        return refused(api.ApiError(503, SHUT_DOWN, code="shutting_down"))
    log.write(200, job)
    return JSONResponse(shape.whole(job, result))


def _stream(
    service: Service, log: _Request, job: Job, shape: Shape, first: tuple[str, Any] | None
) -> Response:
    status = {"code": 499}  # until the stream ends as it should

    async def next_or_keepalive() -> tuple[str, Any] | None:
        try:
            return await asyncio.wait_for(job.events.get(), KEEPALIVE_S)
        except asyncio.TimeoutError:
            return None  # nothing for a while (a long prefill): say the stream lives

    async def events() -> AsyncIterator[bytes]:
        for out in shape.opening():
            yield out
        event = first
        while event is None or event[0] == "text":
            if event is None:
                yield KEEPALIVE
            else:
                for out in shape.piece(event[1]):
                    yield out
            event = await next_or_keepalive()
        if event[0] == "error":
            status["code"] = event[1].status
            for out in shape.broken(event[1], job):
                yield out
            return
        result = event[1]
        if _cut_by_drain(service, result):
            status["code"] = 503
            for out in shape.broken(api.ApiError(503, SHUT_DOWN, code="shutting_down"), job):
                yield out
            return
        for out in shape.closing(job, result):
            yield out
        status["code"] = 200

    def on_close() -> None:
        if job.finished:
            log.write(status["code"], job, stream=True)
        else:
            service.queue.cancel(job)
            _log_when_over(log, job, stream=True)

    return _Stream(events(), on_close)
