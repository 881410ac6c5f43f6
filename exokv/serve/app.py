"""The Starlette application: the API routes over the one turn queue.

POST /v1/chat/completions (OpenAI chat), POST /v1/completions (a prompt in, text
out), POST /v1/messages (Anthropic's Messages API) and /v1/messages/count_tokens (its
prompt's tokens, no turn), POST /v1/responses (OpenAI's Responses API) and GET
/v1/responses/{id}, Ollama's /api/chat, /api/generate, /api/tags, /api/show, /api/ps
and /api/version, GET /v1/models and /v1/models/{id}, GET /metrics (Prometheus), GET
/health. Each API only reads its request into a `TurnRequest` and writes the turn's
events in its own shape (a `Shape`); the job, its queue, its stream, its keep-alives,
its disconnect and its access line are the same for all. Every route but /health is
behind the key (`bound`), unknown routes too, each answering in its API's error shape.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import time
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from exokv.config import debug_enabled
from exokv.core.records import TurnRequest, TurnResult
from exokv.serve import anthropic, api, completions, ollama, responses
from exokv.serve.metrics import Metrics
from exokv.serve.tools import ModelTools
from exokv.serve.work import Job, TurnQueue

DISCONNECT_POLL_S = 0.25  # how often a waiting request checks that its client is still there
DRAIN_BYTES = 16 << 20  # of a body over the limit, read and dropped so the 413 arrives
# A stream's headers wait this long for the turn's first event (so a refused prompt
# is still a 400); a longer prefill is streamed with keep-alive comments meanwhile.
HEAD_WAIT_S = 1.0
KEEPALIVE_S = 5.0  # between two keep-alives (SSE comments) while nothing else is sent
SHUT_DOWN = "the server shut down before the reply was complete"
# A body must have arrived this long after its request's head (a 408 after; the
# connection's own deadline, exokv.serve.connections, is a few seconds later).
BODY_TIMEOUT_S = 60.0
COUNT_WAIT_S = 10.0  # a stream's opening waits this long for its prompt's count
# /metrics labels a request by its route's pattern, and by its method only if HTTP has
# it: a client choosing paths or methods cannot make a series of its own.
METHODS = {"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"}
UNMATCHED = "unmatched"  # the route label of every path no route has
LOGGED_PATH = 200  # characters of a request's path the access line shows at most


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
    # Responses kept for the Responses API's previous_response_id (bounded, in memory).
    response_store: responses.ResponseStore = field(default_factory=responses.ResponseStore)
    # Origins a browser page may call the API from (--allow-origin; "*": any); none:
    # no CORS headers, so browsers keep pages of other origins out.
    allow_origins: list[str] = field(default_factory=list)
    open: int = 0  # requests with a job not answered yet (the drain counts them)
    halted: bool = False  # the drain limit passed: what still runs was stopped

    def in_flight(self) -> int:
        return max(self.open, int(self.queue.busy) + self.queue.waiting)


class Shape(Protocol):
    """One API's request read and reply written (api.ChatShape, completions, anthropic,
    responses, ollama). A shape may name the request's field its prompt is in
    (`prompt_field`, "messages" unless it says), which a too-long prompt's 400 names."""

    stream: bool
    media_type: str  # a stream's

    def keepalive(self) -> bytes: ...

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
        self.route = f"{request.method[:16]} {_printable(request.scope['path'])}"
        self.label = _route_label(request)  # the route's /metrics label
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
        self.service.metrics.answered(self.label, status, job)


def _printable(path: str) -> str:
    """A request's path as the log shows it: what it decodes to, of bounded length, its
    control characters escaped (a decoded %0A or %1B is no new line or terminal code)."""
    cut = path[:LOGGED_PATH]
    shown = "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in cut)
    return shown + ("..." if len(path) > LOGGED_PATH else "")


def _route_label(request: Request) -> str:
    """`METHOD /pattern` of the route that took the request (`/v1/models/{model:path}`
    for any model); UNMATCHED for a path no route has."""
    route = request.scope.get("route")
    path = getattr(route, "path", None)
    if path is None:
        return UNMATCHED
    method = request.method if request.method in METHODS else "OTHER"
    return f"{method} {path}"


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
    """The request body, or 413 once it is over `limit` bytes, or 408 (the connection
    then closed) if it has not all come within BODY_TIMEOUT_S.

    What comes over the limit is read and dropped (up to DRAIN_BYTES more, then the
    connection is given up on): a client still sending when the answer came would see
    its connection reset instead of the 413.
    """
    try:
        return await asyncio.wait_for(_read_body(request, limit), BODY_TIMEOUT_S)
    except asyncio.TimeoutError:
        raise api.ApiError(
            408,
            f"the request body did not arrive within {BODY_TIMEOUT_S:g} s",
            code="request_timeout",
            headers={"Connection": "close"},
        ) from None


async def _read_body(request: Request, limit: int) -> bytes:
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

    def __init__(
        self, content: AsyncIterator[bytes], on_close: Callable[[], None], media_type: str
    ) -> None:
        super().__init__(content, media_type=media_type, headers={"Cache-Control": "no-cache"})
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
    `service`; behind CORS headers for the origins it allows, if any."""

    def bound(
        handler: Handler, error_doc: ErrorDoc = api.ApiError.doc, key: bool = True
    ) -> Callable[[Request], Awaitable[Response]]:
        # A function of its own: Starlette calls a function with the request, but takes
        # anything else (the partial of `turns`) for an ASGI app.
        async def endpoint(request: Request) -> Response:
            if key:
                refused = _key_refused(service, request, error_doc)
                if refused is not None:
                    return refused
            try:
                return await handler(service, request)
            except Exception as err:  # noqa: BLE001 - a fault answered in the API's shape
                return _fault(service, request, err, error_doc)

        return endpoint

    def turns(parse: Parse, error_doc: ErrorDoc) -> Callable[[Request], Awaitable[Response]]:
        return bound(functools.partial(_call, parse=parse, error_doc=error_doc), error_doc)

    async def not_found(request: Request, exc: HTTPException) -> Response:
        error_doc = _error_doc_of(request.url.path)
        refused = _key_refused(service, request, error_doc)  # a scan learns no routes
        return refused or _not_found(service, request, exc, error_doc)

    middleware = []
    if service.allow_origins:
        # Browsers ask first (OPTIONS, no key): answered here, before the key is checked.
        cors = {"allow_methods": ["GET", "POST"], "allow_headers": ["*"], "max_age": 600}
        middleware.append(Middleware(CORSMiddleware, allow_origins=service.allow_origins, **cors))
    anthropic_doc = anthropic.error_doc
    return Starlette(
        routes=[
            Route("/health", bound(_health, key=False), methods=["GET"]),
            Route("/metrics", bound(_metrics), methods=["GET"]),
            Route("/v1/models", bound(_models), methods=["GET"]),
            Route("/v1/models/{model:path}", bound(_model), methods=["GET"]),
            Route("/v1/chat/completions", turns(_chat, api.ApiError.doc), methods=["POST"]),
            Route("/v1/completions", turns(_complete, api.ApiError.doc), methods=["POST"]),
            Route("/v1/messages", turns(_messages, anthropic_doc), methods=["POST"]),
            Route(
                "/v1/messages/count_tokens", bound(_count_tokens, anthropic_doc), methods=["POST"]
            ),
            Route("/v1/responses", turns(_responses, api.ApiError.doc), methods=["POST"]),
            Route("/v1/responses/{ident}", bound(_stored_response), methods=["GET"]),
            Route("/api/chat", turns(_ollama_chat, ollama.error_doc), methods=["POST"]),
            Route("/api/generate", turns(_ollama_generate, ollama.error_doc), methods=["POST"]),
            Route("/api/show", bound(_ollama_info, ollama.error_doc), methods=["POST"]),
            *(
                Route(f"/api/{n}", bound(_ollama_info, ollama.error_doc))
                for n in ("tags", "ps", "version")
            ),
        ],
        exception_handlers={HTTPException: not_found},
        middleware=middleware,
    )


def _error_doc_of(path: str) -> ErrorDoc:
    """The error shape of the API a path is under (an unknown route's)."""
    if path.startswith("/v1/messages"):
        return anthropic.error_doc
    return ollama.error_doc if path.startswith("/api/") else api.ApiError.doc


def _key_refused(service: Service, request: Request, error_doc: ErrorDoc) -> Response | None:
    """The 401 (logged) of a request without the server's key; None: it may go on."""
    try:
        _check_key(service, request)
    except api.ApiError as err:
        _Request(service, request).write(err.status)
        return _refusal(err, error_doc)
    return None


def _fault(service: Service, request: Request, err: Exception, error_doc: ErrorDoc) -> Response:
    """A handler's own failure: one log line and a 500 in the API's shape, not a
    traceback and a plain-text 500."""
    what = f"{type(err).__name__}: {err}"[:300]
    service.log(f"exokv: internal error on {request.method} {request.url.path}: {what}")
    if debug_enabled():
        service.log("".join(traceback.format_exception(err)).rstrip())
    _Request(service, request).write(500)
    return _refusal(api.ApiError(500, f"internal error: {what}"), error_doc)


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


def _model_entry(service: Service) -> dict[str, Any]:
    return {"id": service.model, "object": "model", "created": 0, "owned_by": "exokv"}


async def _models(service: Service, request: Request) -> Response:
    _Request(service, request).write(200)
    return JSONResponse({"object": "list", "data": [_model_entry(service)]})


async def _model(service: Service, request: Request) -> Response:
    """GET /v1/models/{id} (the openai client's models.retrieve): the loaded model by
    any name that selects it; another is a 404 as OpenAI answers one."""
    name = request.path_params["model"]
    log = _Request(service, request)
    if name not in service.names:
        log.write(404)
        return _refusal(api.unknown_model(name, service.names))
    log.write(200)
    return JSONResponse(_model_entry(service))


async def _metrics(service: Service, request: Request) -> Response:
    # Requests whose answer has not gone out: not in_flight(), which also counts a batch
    # still storing its rows' caches after the last answer went (the drain waits for it).
    text = service.metrics.render(service.queue.waiting, service.open)
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


def _responses(service: Service, body: bytes) -> tuple[TurnRequest, list[str], Shape]:
    call = responses.parse(
        body, service.names, service.defaults, service.limits, service.response_store
    )
    shape = responses.Shape(
        service.model, call, _model_tools(service, call), service.response_store
    )
    return _turn(service, call, shape.turn_messages()), call.stop, shape


async def _stored_response(service: Service, request: Request) -> Response:
    log = _Request(service, request)  # its key checked by `bound`, its label the pattern
    try:
        doc = service.response_store.doc(request.path_params["ident"])
    except api.ApiError as err:
        log.write(err.status)
        return _refusal(err)
    log.write(200)
    return JSONResponse(doc)


def _ollama_chat(service: Service, body: bytes) -> tuple[TurnRequest, list[str], Shape]:
    call = ollama.parse_chat(body, service.names, service.defaults, service.limits)
    shape = ollama.Shape(service.model, call, _model_tools(service, call))
    return _turn(service, call, shape.turn_messages()), call.stop, shape


def _ollama_generate(service: Service, body: bytes) -> tuple[TurnRequest, list[str], Shape]:
    call = ollama.parse_generate(body, service.names, service.defaults, service.limits)
    return _turn(service, call), call.stop, ollama.Shape(service.model, call)


async def _ollama_info(service: Service, request: Request) -> Response:
    """Ollama's /api/tags, /api/ps, /api/version and /api/show: the served model."""
    log = _Request(service, request)  # its key checked by `bound`
    try:
        what = request.url.path.removeprefix("/api/")
        if what == "version":
            doc = {"version": ollama.VERSION}
        else:
            # Reading the model's files (and, to show, its template): not in the event loop.
            card = await asyncio.to_thread(
                ollama.model_card, service.model, frozenset(service.names)
            )
            if what == "show":
                body = await _body(request, service.limits.body_bytes)
                tools = await asyncio.to_thread(service.tools)
                doc = ollama.show(body, card, service.names, tools)
            else:
                doc = ollama.tags(card) if what == "tags" else ollama.running(card)
    except api.ApiError as err:
        log.write(err.status)
        return _refusal(err, ollama.error_doc)
    except ClientDisconnect:
        log.write(499)
        return Response(status_code=499)
    log.write(200)
    return JSONResponse(doc)


async def _count_tokens(service: Service, request: Request) -> Response:
    log = _Request(service, request)
    try:
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


def _not_found(
    service: Service, request: Request, exc: HTTPException, error_doc: ErrorDoc
) -> Response:
    log = _Request(service, request)
    err = api.ApiError(exc.status_code, f"{log.route}: {exc.detail}")
    log.write(exc.status_code)
    return _refusal(err, error_doc)


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
        body = await _body(request, service.limits.body_bytes)
        turn, stops, shape = parse(service, body)
        prompt_field = getattr(shape, "prompt_field", "messages")
        job = Job(turn, stops, asyncio.get_running_loop(), prompt_field)
        service.queue.submit(job)
        log.opened()
        service.metrics.queued(job)
        counting = _counting(service, turn, shape)
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
        return _stream(service, log, job, shape, first, counting)
    return await _whole(service, log, job, request, first, shape, refused)


def _counting(service: Service, turn: TurnRequest, shape: Shape) -> asyncio.Task[int] | None:
    """For a stream whose opening says its prompt's tokens (`opening_counts_prompt`:
    Anthropic's message_start), their count, rendered in the front end
    (exokv.serve.prompts) while the ranks run the turn; None for any other."""
    if not (shape.stream and getattr(shape, "opening_counts_prompt", False)):
        return None
    if service.count is None:
        return None
    task = asyncio.get_running_loop().create_task(asyncio.to_thread(service.count, turn))
    task.add_done_callback(lambda t: t.cancelled() or t.exception())  # read if unused
    return task


async def _counted(counting: asyncio.Task[int]) -> int | None:
    """The count, once done (None: it failed or took over COUNT_WAIT_S)."""
    try:
        return await asyncio.wait_for(asyncio.shield(counting), COUNT_WAIT_S)
    except Exception:  # noqa: BLE001 - the opening says what it knows: no count
        return None


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


def _queued_texts(job: Job, text: str) -> tuple[str, tuple[str, Any] | None]:
    """`text` and the text events queued behind it, joined, and the first queued event
    that is not text (taken), if any. A front end that fell behind the batch (64 streams
    each given a piece at every decode step) so sends a stream's waiting pieces as one
    chunk in one write, rather than one each: the cost per chunk (JSON, the ASGI send,
    the socket write) is most of this process's share of the CPU the ranks need."""
    parts = [text]
    while not job.events.empty():
        event = job.events.get_nowait()
        if event[0] != "text":
            return "".join(parts), event
        parts.append(event[1])
    return "".join(parts), None


def _stream(
    service: Service,
    log: _Request,
    job: Job,
    shape: Shape,
    first: tuple[str, Any] | None,
    counting: asyncio.Task[int] | None = None,
) -> Response:
    status = {"code": 499}  # until the stream ends as it should

    async def next_or_keepalive() -> tuple[str, Any] | None:
        try:
            return await asyncio.wait_for(job.events.get(), KEEPALIVE_S)
        except asyncio.TimeoutError:
            return None  # nothing for a while (a long prefill): say the stream lives

    async def events() -> AsyncIterator[bytes]:
        if counting is not None:
            shape.prompt_tokens = await _counted(counting)  # type: ignore[attr-defined]
        for out in shape.opening():
            yield out
        event = first
        while event is None or event[0] == "text":
            following = None
            if event is None:
                yield shape.keepalive()
            else:
                text, following = _queued_texts(job, event[1])
                out = b"".join(shape.piece(text))
                if out:
                    yield out
            event = following or await next_or_keepalive()
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

    return _Stream(events(), on_close, shape.media_type)
