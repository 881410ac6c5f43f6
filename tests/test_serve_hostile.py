"""What a hostile or careless client sends `exokv serve`, answered in each API's shape
(issue 44, items 7-9): the app in this process (Starlette's TestClient), its queue over
a scripted client (no ranks, no server)."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable, Iterator
from typing import Any

import openai
import pytest
from starlette.testclient import TestClient

from exokv.core.records import NO_CALLS, BatchCalls, RankStats, RowOutcome, TurnRequest, TurnResult
from exokv.errors import ExokvError, PromptTooLong, UsageError
from exokv.frontend.start import ChatOptions
from exokv.serve import api
from exokv.serve import app as app_module
from exokv.serve.app import Service, build_app
from exokv.serve.metrics import Metrics
from exokv.serve.run import ServeOptions, check, origins
from exokv.serve.work import TurnQueue
from tests.stub_client import StubClient

KEY = "sekrit"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = "/v1/messages"
COUNT = "/v1/messages/count_tokens"
RESPONSES = "/v1/responses"
OLLAMA_CHAT = "/api/chat"
OLLAMA_GENERATE = "/api/generate"
USER = [{"role": "user", "content": "hi"}]


def _encoded(request: TurnRequest) -> int:
    """The prompt's 'tokens' as a tokenizer counts them: its UTF-8 bytes (a lone
    surrogate fails here as it fails a real tokenizer)."""
    return sum(len(str(m["content"]).encode()) for m in request.messages)


class Scripted(StubClient):
    """A turn that streams `pieces` (stopping when told, as the ranks do), or raises
    `error` after them; its prompt 'tokenized' as its UTF-8 bytes."""

    def __init__(self, pieces: list[str], error: Exception | None = None) -> None:
        self.pieces = pieces
        self.error = error
        self.stopped = threading.Event()

    def stop_now(self) -> None:
        self.stopped.set()

    def turn(
        self,
        request: TurnRequest,
        on_text: Callable[[str], None] | None = None,
        on_progress: Callable[[int, int], None] | None = None,
    ) -> TurnResult:
        prompt = _encoded(request)
        self.stopped.clear()
        sent, finish = 0, "stop"
        for piece in self.pieces:
            if self.stopped.is_set():
                finish = "interrupted"
                break
            if on_text is not None:
                on_text(piece)
            sent += 1
        if self.error is not None:
            raise self.error
        return TurnResult(
            session=request.session,
            reply="".join(self.pieces[:sent]),
            prompt_tokens=prompt,
            cached_tokens=2,
            prefilled_tokens=prompt - 2,
            generated_tokens=sent,
            ttft_s=0.0,
            decode_tps=0.0,
            overhead_s=0.0,
            ranks=1,
            finish_reason=finish,
            rank_stats=[RankStats(0, 1276930, 1, None, 0.0, 1 << 30, 1 << 20, 1 << 20)],
        )


class App:
    """A service over `client`, its app in a TestClient, and its access log."""

    def __init__(self, client: StubClient, batch: int = 1, **service: Any) -> None:
        self.log: list[str] = []
        self.queue = TurnQueue(client, 8, batch=batch)
        self.service = Service(
            model="m",
            names={"m"},
            queue=self.queue,
            ranks=1,
            log=self.log.append,
            **{"count": _encoded, **service},
        )
        self.http = TestClient(build_app(self.service), raise_server_exceptions=False)

    def post(self, path: str, doc: Any = None, body: bytes | None = None, **kw: Any) -> Any:
        content = body if body is not None else json.dumps(doc).encode()
        headers = {"content-type": "application/json", **kw.pop("headers", {})}
        return self.http.post(path, content=content, headers=headers, **kw)

    def metrics(self, **kw: Any) -> str:
        return self.http.get("/metrics", **kw).text

    def close(self) -> None:
        self.http.close()
        self.queue.close(timeout=1)


@pytest.fixture
def make() -> Iterator[Callable[..., App]]:
    apps: list[App] = []

    def start(pieces: list[str] | None = None, error: Exception | None = None, **kw: Any) -> App:
        apps.append(App(Scripted(pieces or ["Hello", " there"], error), **kw))
        return apps[-1]

    yield start
    for a in apps:
        a.close()


def sse(response: Any) -> list[Any]:
    """A stream's data lines, decoded ([DONE] kept as the string)."""
    out = []
    for line in response.text.splitlines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def anthropic_error(response: Any) -> dict[str, Any]:
    doc = response.json()
    assert doc["type"] == "error" and set(doc["error"]) == {"type", "message"}, doc
    return doc["error"]


def ollama_error(response: Any) -> dict[str, Any]:
    doc = response.json()
    assert set(doc) == {"error"} and isinstance(doc["error"], str), doc
    return {"message": doc["error"]}


def openai_error(response: Any) -> dict[str, Any]:
    doc = response.json()
    assert set(doc["error"]) == {"message", "type", "param", "code"}, doc
    return doc["error"]


# -- a lone surrogate, a body nested too deep ------------------------------------------

SURROGATE = "<surrogate>"  # sent as a client sends it: a JSON escape json.loads takes


def _with_surrogate(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc).replace(f'"{SURROGATE}"', '"a\\ud800b"').encode()


def _said(role: str, content: Any) -> list[dict[str, Any]]:
    return [{"role": role, "content": content}]


PARTS = [{"type": "text", "text": SURROGATE}]
SURROGATES = [
    (CHAT, {"messages": _said("user", SURROGATE)}, "messages[0].content", "messages"),
    (CHAT, {"messages": _said("system", PARTS) + USER}, "messages[0].content[0].text", "messages"),
    (COMPLETIONS, {"prompt": SURROGATE}, "prompt", "prompt"),
    (COMPLETIONS, {"prompt": "x", "stop": ["a", SURROGATE]}, "stop[1]", "stop"),
    (MESSAGES, {"max_tokens": 5, "messages": _said("user", SURROGATE)}, "messages[0].content", ""),
    (MESSAGES, {"max_tokens": 5, "system": SURROGATE, "messages": USER}, "system", ""),
    (COUNT, {"messages": _said("user", PARTS)}, "messages[0].content[0].text", ""),
    (RESPONSES, {"input": SURROGATE}, "input", "input"),
    (RESPONSES, {"input": "x", "instructions": SURROGATE}, "instructions", "instructions"),
    (OLLAMA_CHAT, {"model": "m", "messages": _said("user", SURROGATE)}, "messages[0].content", ""),
    (OLLAMA_GENERATE, {"model": "m", "prompt": SURROGATE}, "prompt", ""),
]


@pytest.mark.parametrize("path, doc, where, param", SURROGATES)
def test_a_lone_surrogate_is_a_400_naming_the_field(make, path, doc, where, param) -> None:
    app = make()
    response = app.post(path, body=_with_surrogate(doc))
    assert response.status_code == 400, response.text
    if path.startswith(MESSAGES):
        error = anthropic_error(response)  # Anthropic's errors have no param
        assert error["type"] == "invalid_request_error"
    elif path.startswith("/api/"):
        error = ollama_error(response)  # Ollama's errors are one string
    else:
        error = openai_error(response)
        assert error["param"] == param
    assert error["message"].startswith(f"{where} has a lone surrogate (U+D800)")
    assert any(f"POST {path} 400" in line for line in app.log)


def test_a_surrogate_pair_is_text(make) -> None:
    app = make()
    response = app.post(CHAT, body=b'{"messages": [{"role": "user", "content": "\\ud83d\\ude00"}]}')
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS, MESSAGES, COUNT])
def test_a_body_of_nested_arrays_is_a_400_in_the_apis_shape(make, path) -> None:
    app = make()
    body = b"[" * 100_000 + b"]" * 100_000  # 200 KB: json.loads alone raises RecursionError
    response = app.post(path, body=body)
    assert response.status_code == 400, response.text[:300]
    error = anthropic_error(response) if path.startswith(MESSAGES) else openai_error(response)
    assert "more than 64 deep" in error["message"]
    assert any(f"POST {path} 400" in line for line in app.log)  # an access line
    assert f'exokv_requests_total{{route="POST {path}",status="400"}} 1' in app.metrics()


def test_a_request_nested_within_json_but_deeper_than_the_bound_is_refused(make) -> None:
    app = make()
    schema: dict[str, Any] = {"type": "object"}
    for _ in range(70):
        schema = {"type": "object", "properties": {"a": schema}}
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    response = app.post(CHAT, {"messages": USER, "tools": [tool]})
    assert response.status_code == 400
    assert "more than 64 deep" in openai_error(response)["message"]


@pytest.mark.parametrize(
    "body, deep",
    [
        (b'{"prompt": "' + b"[" * 200 + b'"}', False),  # brackets in a string are text
        (b'{"prompt": "x\\"[[[[", "b": ' + b"[" * 64 + b"]" * 64 + b"}", False),
        (b'{"prompt": "x\\\\", "b": ' + b"[" * 65 + b"]" * 65 + b"}", True),
        (b'{"prompt": "\\\\ud800"}', False),  # an escaped backslash, then text
    ],
)
def test_depth_is_of_arrays_and_objects_not_of_text(body: bytes, deep: bool) -> None:
    if deep:
        with pytest.raises(api.ApiError, match="more than 64 deep"):
            api.read_doc(body, {"m"})
    else:
        assert api.read_doc(body, {"m"})["prompt"]


# -- parameters taken and not applied ---------------------------------------------------


UNAPPLIED = [
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"frequency_penalty": -1}, "frequency_penalty"),
    ({"frequency_penalty": "high"}, "frequency_penalty"),
    ({"logit_bias": {"50256": -100}}, "logit_bias"),
    ({"logit_bias": [1]}, "logit_bias"),
    ({"reasoning_effort": "low"}, "reasoning_effort"),
]
FORCED_WITHOUT_TOOLS = [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
]


@pytest.mark.parametrize(
    "path, extra, param",
    [(CHAT, *case) for case in UNAPPLIED + FORCED_WITHOUT_TOOLS]
    + [(COMPLETIONS, *case) for case in UNAPPLIED],
)
def test_a_parameter_not_applied_is_refused_naming_it(make, path, extra, param) -> None:
    app = make()
    doc = {"messages": USER} if path == CHAT else {"prompt": "hi"}
    response = app.post(path, {**doc, **extra})
    assert response.status_code == 400, response.text
    assert openai_error(response)["param"] == param


def test_the_values_that_change_nothing_are_taken(make) -> None:
    app = make()
    neutral = {"presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}}
    for path, doc in (
        (CHAT, {"messages": USER, "tool_choice": "none"}),
        (COMPLETIONS, {"prompt": "hi"}),
    ):
        response = app.post(path, {**doc, **neutral})
        assert response.status_code == 200, response.text


def test_anthropic_tool_choice_any_without_tools_is_refused(make) -> None:
    app = make()
    doc = {"max_tokens": 5, "messages": USER, "tool_choice": {"type": "any"}}
    response = app.post(MESSAGES, doc)
    assert response.status_code == 400
    assert "no tools" in anthropic_error(response)["message"]


# -- replies: finish, usage, the prompt's field ------------------------------------------


def test_a_stop_sequence_is_finish_stop_in_the_log_as_for_the_client(make) -> None:
    app = make(["Hello", " STOP", " never"])
    done = app.post(CHAT, {"messages": USER, "stop": ["STOP"]}).json()
    assert done["choices"][0]["finish_reason"] == "stop"
    assert done["choices"][0]["message"]["content"] == "Hello "
    streamed = app.post(CHAT, {"messages": USER, "stop": "STOP", "stream": True})
    assert sse(streamed)[-2]["choices"][0]["finish_reason"] == "stop"
    lines = [x for x in app.log if f"POST {CHAT} 200" in x]
    assert len(lines) == 2 and all(" finish=stop " in x for x in lines), lines


def test_anthropic_message_start_says_the_prompts_tokens(make) -> None:
    app = make()
    doc = {"max_tokens": 5, "messages": [{"role": "user", "content": "twelve chars"}]}
    response = app.post(MESSAGES, {**doc, "stream": True})
    events = sse(response)
    start = events[0]
    assert start["type"] == "message_start"
    counted = _encoded(TurnRequest(session="s", messages=doc["messages"]))
    assert start["message"]["usage"]["input_tokens"] == counted
    end = next(e for e in events if e["type"] == "message_delta")["usage"]
    split = end["input_tokens"] + end["cache_read_input_tokens"]
    assert split + end["cache_creation_input_tokens"] == counted  # the same prompt, split


def test_anthropic_cache_creation_is_what_the_request_added_to_the_cache(make) -> None:
    app = make()
    usage = app.post(MESSAGES, {"max_tokens": 5, "messages": USER}).json()["usage"]
    prompt = _encoded(TurnRequest(session="s", messages=USER))
    assert usage["cache_read_input_tokens"] == 2
    assert usage["cache_creation_input_tokens"] == prompt - 2  # the prompt not served
    assert usage["input_tokens"] == 0
    off = make(use_cache=False)  # --no-cache: nothing is added to the cache
    usage = off.post(MESSAGES, {"max_tokens": 5, "messages": USER}).json()["usage"]
    assert usage["cache_creation_input_tokens"] == 0


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_a_failed_turn_still_ends_with_the_usage_asked_for(make, path) -> None:
    app = make(["Hel"], error=ExokvError("rank 1 died"))
    doc = {"messages": USER} if path == CHAT else {"prompt": "hi"}
    doc |= {"stream": True, "stream_options": {"include_usage": True}}
    events = sse(app.post(path, doc))
    assert events[-1] == "[DONE]"
    assert any("error" in e for e in events if isinstance(e, dict))
    usage = events[-2]["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


@pytest.mark.parametrize("path, field", [(CHAT, "messages"), (COMPLETIONS, "prompt")])
def test_a_prompt_over_the_context_names_the_field_it_is_in(make, path, field) -> None:
    app = make(error=PromptTooLong("too long", tokens=5000, context=4096))
    doc = {"messages": USER} if path == CHAT else {"prompt": "hi"}
    error = openai_error(app.post(path, doc))
    assert error["param"] == field and error["code"] == "context_length_exceeded"
    assert f"your {field} " in error["message"]


# -- routes: models, metrics, the key, CORS ------------------------------------------------


def test_a_model_is_retrieved_by_the_openai_client(make) -> None:
    app = make()
    client = openai.OpenAI(
        base_url="http://testserver/v1", api_key="none", http_client=app.http, max_retries=0
    )
    assert client.models.retrieve("m").id == "m"
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("gpt-5")
    assert caught.value.body["code"] == "model_not_found"


def test_unknown_paths_share_one_metrics_label(make) -> None:
    app = make()
    for n in range(5):
        assert app.http.get(f"/scan/{n}").status_code == 404
        app.http.get(f"/v1/models/other-{n}")
    app.http.request("BREW", "/v1/models")
    text = app.metrics()
    assert 'exokv_requests_total{route="unmatched",status="404"} 5' in text
    assert 'exokv_requests_total{route="GET /v1/models/{model:path}",status="404"} 5' in text
    assert 'route="OTHER /v1/models",status="405"' in text
    assert "/scan/" not in text and "other-" not in text and "BREW" not in text
    assert sum(1 for x in app.log if "GET /scan/" in x) == 5  # the log keeps the paths


def test_a_path_is_one_line_of_the_log(make) -> None:
    app = make()
    app.http.get("/%C3%A9%1B[2J%0A2026-01-01T00:00:00 1.2.3.4:5 GET /forged 200" + "y" * 1000)
    line = app.log[-1]
    assert "\n" not in line and "\x1b" not in line and len(line) < 400
    assert " GET /é\\x1b[2J\\n2026-01-01" in line


def test_byte_gauges_are_whole_numbers(make) -> None:
    app = make()
    app.post(CHAT, {"messages": USER})
    text = app.metrics()
    assert 'exokv_cache_bytes{rank="0"} 1276930\n' in text
    assert "e+" not in text


class WindingDown(Scripted):
    """A batch that answers its one row, then goes on (storing the row's cache, as the
    ranks do after the last answer) until `release`."""

    def __init__(self) -> None:
        super().__init__(["Hello"])
        self.release = threading.Event()

    def turns(self, requests: list[TurnRequest], calls: BatchCalls = NO_CALLS) -> list[RowOutcome]:
        outcome = RowOutcome(result=self.turn(requests[0]))
        assert calls.on_row is not None
        calls.on_row(0, outcome)
        self.release.wait(timeout=30)
        return [outcome]


def test_an_answered_request_is_not_in_flight_while_its_batch_winds_down() -> None:
    client = WindingDown()
    app = App(client, batch=8)
    try:
        assert app.post(CHAT, {"messages": USER}).status_code == 200
        assert app.queue.busy  # the batch has not ended ...
        assert "exokv_requests_in_flight 0\n" in app.metrics()  # ... its one request has
    finally:
        client.release.set()
        app.close()


def test_metrics_values_render_whole_and_fractional() -> None:
    metrics = Metrics()
    metrics.cache_bytes[0] = 123456789012
    text = metrics.render(waiting=3, in_flight=0)
    assert 'exokv_cache_bytes{rank="0"} 123456789012' in text
    assert "exokv_queue_depth 3\n" in text


ROUTES = [
    ("GET", "/metrics", openai_error),
    ("GET", "/v1/models", openai_error),
    ("GET", "/v1/models/m", openai_error),
    ("POST", CHAT, openai_error),
    ("POST", COMPLETIONS, openai_error),
    ("POST", MESSAGES, anthropic_error),
    ("POST", COUNT, anthropic_error),
    ("GET", "/no/such/route", openai_error),
    ("POST", "/v1/messages/batches", anthropic_error),
    ("POST", RESPONSES, openai_error),
    ("GET", RESPONSES + "/resp_1", openai_error),
    ("POST", OLLAMA_CHAT, ollama_error),
    ("POST", OLLAMA_GENERATE, ollama_error),
    ("GET", "/api/tags", ollama_error),
    ("POST", "/api/show", ollama_error),
    ("GET", "/api/no_such_route", ollama_error),
]


@pytest.mark.parametrize("method, path, shape", ROUTES)
def test_every_route_but_health_is_behind_the_key(make, method, path, shape) -> None:
    app = make(api_key=KEY)
    response = app.http.request(method, path, content=b"{}")
    assert response.status_code == 401, (path, response.text)
    assert shape(response)
    assert any(f"{method} {path} 401" in line for line in app.log)
    keyed = app.http.request(method, path, content=b"{}", headers={"x-api-key": KEY})
    assert keyed.status_code != 401
    assert app.http.get("/health").status_code == 200


def test_a_handler_fault_is_a_500_in_the_apis_shape_with_its_line(make) -> None:
    def broken(request: TurnRequest) -> int:
        raise RuntimeError("the renderer broke")

    app = make(count=broken)
    response = app.post(COUNT, {"messages": USER})
    assert response.status_code == 500
    assert "the renderer broke" in anthropic_error(response)["message"]
    assert any(f"POST {COUNT} 500" in line for line in app.log)
    assert any("internal error on POST" in line for line in app.log)


def test_a_handler_faults_traceback_is_logged_with_exokv_debug(make, monkeypatch) -> None:
    def broken(request: TurnRequest) -> int:
        raise RuntimeError("the renderer broke")

    monkeypatch.setenv("EXOKV_DEBUG", "1")
    app = make(count=broken)
    assert app.post(COUNT, {"messages": USER}).status_code == 500
    assert any(line.startswith("Traceback (most recent call last)") for line in app.log)


def test_no_cors_headers_unless_an_origin_is_allowed(make) -> None:
    origin = {"origin": "http://localhost:3000"}
    closed = make()
    assert (
        "access-control-allow-origin" not in closed.http.get("/v1/models", headers=origin).headers
    )
    app = make(api_key=KEY, allow_origins=["http://localhost:3000"])
    preflight = app.http.options(
        CHAT,
        headers={
            **origin,
            "access-control-request-method": "POST",
            "access-control-request-headers": "authorization, content-type, x-stainless-os",
        },
    )
    assert preflight.status_code == 200  # no key: a browser sends none when it asks
    assert preflight.headers["access-control-allow-origin"] == "http://localhost:3000"
    assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
    keyed = {**origin, "authorization": f"Bearer {KEY}"}
    reply = app.post(CHAT, {"messages": USER}, headers=keyed)
    assert reply.status_code == 200
    assert reply.headers["access-control-allow-origin"] == "http://localhost:3000"
    other = app.http.get("/v1/models", headers={**keyed, "origin": "http://evil.example"})
    assert other.headers.get("access-control-allow-origin") != "http://evil.example"


# -- a body that never comes whole -------------------------------------------------------


def test_a_body_that_stops_coming_is_a_408_and_the_connection_closes(make, monkeypatch) -> None:
    monkeypatch.setattr(app_module, "BODY_TIMEOUT_S", 0.2)
    app = make()
    asgi = build_app(app.service)
    sent: list[dict[str, Any]] = []

    async def run() -> None:
        first = True

        async def receive() -> dict[str, Any]:
            nonlocal first
            if first:
                first = False
                return {"type": "http.request", "body": b'{"messages": [', "more_body": True}
            await asyncio.sleep(60)  # the rest never comes
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        scope = {
            "type": "http",
            "method": "POST",
            "path": MESSAGES,
            "raw_path": MESSAGES.encode(),
            "query_string": b"",
            "headers": [(b"content-type", b"application/json"), (b"content-length", b"999")],
            "client": ("127.0.0.1", 5000),
            "server": ("127.0.0.1", 8000),
            "scheme": "http",
            "http_version": "1.1",
            "root_path": "",
        }
        await asyncio.wait_for(asgi(scope, receive, send), 5)

    asyncio.run(run())
    start = sent[0]
    assert start["status"] == 408
    assert (b"connection", b"close") in start["headers"]
    body = json.loads(b"".join(m.get("body", b"") for m in sent[1:]))
    assert body["type"] == "error" and "did not arrive within 0.2 s" in body["error"]["message"]
    assert body["error"]["type"] == "invalid_request_error"
    assert any(f"POST {MESSAGES} 408" in line for line in app.log)


def test_allowed_origins_are_read_and_checked() -> None:
    given = ["http://localhost:3000, https://chat.example:8443", "*"]
    assert origins(given) == ("http://localhost:3000", "https://chat.example:8443", "*")
    assert origins(None) == ()
    tiny = ChatOptions(model="builtin:tiny")
    assert check(ServeOptions(tiny, allow_origins=origins(given))) == []
    for bad in ("http://localhost:3000/", "localhost:3000", "http://a.example/path"):
        with pytest.raises(UsageError, match="--allow-origin"):
            check(ServeOptions(tiny, allow_origins=(bad,)))
