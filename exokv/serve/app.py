"""The Starlette application: OpenAI's routes over the turn queue.

POST /v1/chat/completions, GET /v1/models, GET /health. Every error is OpenAI's
error shape with its status; one access log line per request.
"""

from __future__ import annotations

import asyncio
import hmac
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from exokv.records import TurnRequest
from exokv.serve import api
from exokv.serve.work import Job, TurnQueue

DISCONNECT_POLL_S = 0.25  # how often a waiting request checks that its client is still there
DRAIN_BYTES = 16 << 20  # of a body over the limit, read and dropped so the 413 arrives


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
    log: Callable[[str], None] = print
    failure: Callable[[], str | None] = lambda: None


class Disconnected(Exception):
    """The client went away before its reply was complete."""


def error_response(err: api.ApiError) -> JSONResponse:
    return JSONResponse(err.doc(), status_code=err.status, headers=err.headers)


class _Request:
    """One request's log line: time, route, status, tokens, cached, TTFT, duration."""

    def __init__(self, service: Service, request: Request) -> None:
        self.service = service
        self.started = time.perf_counter()
        client = request.client
        self.peer = f"{client.host}:{client.port}" if client else "-"
        self.route = f"{request.method} {request.url.path}"

    def write(self, status: int, job: Job | None = None, stream: bool = False) -> None:
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
        if job is not None and job.ttft_s is not None:
            parts.append(f"ttft={job.ttft_s:.3f}s")
        if job is not None and job.batch > 1:
            parts.append(f"batch={job.batch}")  # decoded together with batch-1 others
        parts.append(f"time={time.perf_counter() - self.started:.3f}s")
        if stream:
            parts.append("stream")
        self.service.log(" ".join(parts))


def _check_key(service: Service, request: Request) -> None:
    if service.api_key is None:
        return
    given = request.headers.get("authorization", "")
    scheme, _, key = given.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(
        key.strip().encode(), service.api_key.encode()
    ):
        raise api.ApiError(
            401,
            "missing or wrong API key: send 'Authorization: Bearer KEY'",
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


async def _next_event(job: Job, request: Request) -> tuple[str, Any]:
    """The job's next event; Disconnected (the job cancelled) if the client leaves first."""
    while True:
        try:
            return await asyncio.wait_for(job.events.get(), DISCONNECT_POLL_S)
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
        finally:
            self.on_close()


def build_app(service: Service) -> Starlette:
    async def health(request: Request) -> Response:
        failure = service.failure()
        doc = {
            "status": "failed" if failure else "ok",
            "model": service.model,
            "ranks": service.ranks,
            "waiting": service.queue.waiting,
            "busy": service.queue.busy,
        }
        if failure:
            doc["error"] = failure
        return JSONResponse(doc, status_code=503 if failure else 200)

    async def models(request: Request) -> Response:
        log = _Request(service, request)
        try:
            _check_key(service, request)
        except api.ApiError as err:
            log.write(err.status)
            return error_response(err)
        log.write(200)
        entry = {"id": service.model, "object": "model", "created": 0, "owned_by": "exokv"}
        return JSONResponse({"object": "list", "data": [entry]})

    async def chat_completions(request: Request) -> Response:
        log = _Request(service, request)
        job: Job | None = None
        try:
            _check_key(service, request)
            body = await _body(request, service.limits.body_bytes)
            call = api.parse_chat(body, service.names, service.defaults, service.limits)
            job = Job(
                TurnRequest(
                    session=api.conversation_name(call.messages),
                    messages=call.messages,
                    max_tokens=call.max_tokens,
                    temp=call.temperature,
                    use_cache=service.use_cache,
                    top_p=call.top_p,
                    sample_seed=call.seed,
                ),
                call.stop,
                asyncio.get_running_loop(),
            )
            service.queue.submit(job)
            first = await _next_event(job, request)  # errors (a prompt too long) before headers
            if first[0] == "error":
                raise first[1]
        except api.ApiError as err:
            log.write(err.status, job)
            return error_response(err)
        except (Disconnected, ClientDisconnect):
            if job is None:
                log.write(499)
            else:
                service.queue.cancel(job)
                _log_when_over(log, job)
            return Response(status_code=499)
        ident = f"chatcmpl-{secrets.token_hex(12)}"
        if call.stream:
            return _stream(service, log, job, call, first, ident)
        return await _whole(service, log, job, request, first, ident)

    async def not_found(request: Request, exc: HTTPException) -> Response:
        err = api.ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}")
        _Request(service, request).write(exc.status_code)
        return error_response(err)

    return Starlette(
        routes=[
            Route("/health", health, methods=["GET"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        ],
        exception_handlers={HTTPException: not_found},
    )


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


async def _whole(
    service: Service,
    log: _Request,
    job: Job,
    request: Request,
    event: tuple[str, Any],
    ident: str,
) -> Response:
    try:
        while event[0] == "text":
            event = await _next_event(job, request)
    except Disconnected:
        service.queue.cancel(job)
        _log_when_over(log, job)
        return Response(status_code=499)
    if event[0] == "error":
        log.write(event[1].status, job)
        return error_response(event[1])
    result = event[1]
    finish = api.finish_reason(result.finish_reason, job.stop_text.hit)
    used = api.usage(result.prompt_tokens, result.cached_tokens, result.generated_tokens)
    log.write(200, job)
    return JSONResponse(api.completion(ident, service.model, job.reply, finish, used))


def _stream(
    service: Service,
    log: _Request,
    job: Job,
    call: api.ChatCall,
    first: tuple[str, Any],
    ident: str,
) -> Response:
    status = {"code": 499}  # until the stream ends as it should

    async def events() -> AsyncIterator[bytes]:
        model = service.model
        yield api.sse(api.chunk(ident, model, {"role": "assistant", "content": ""}))
        event = first
        while event[0] == "text":
            yield api.sse(api.chunk(ident, model, {"content": event[1]}))
            event = await job.events.get()
        if event[0] == "error":
            status["code"] = event[1].status
            yield api.sse(event[1].doc())
            return
        result = event[1]
        finish = api.finish_reason(result.finish_reason, job.stop_text.hit)
        yield api.sse(api.chunk(ident, model, {}, finish))
        if call.include_usage:
            used = api.usage(result.prompt_tokens, result.cached_tokens, result.generated_tokens)
            yield api.sse(api.chunk(ident, model, None, used=used))
        yield api.sse("[DONE]")
        status["code"] = 200

    def on_close() -> None:
        if job.finished:
            log.write(status["code"], job, stream=True)
        else:
            service.queue.cancel(job)
            _log_when_over(log, job, stream=True)

    return _Stream(events(), on_close)
