"""The Ollama API's parts, in this process: options and fields read or refused, and the
app's replies (streamed NDJSON and whole, a tool call, a model load, errors), each
line read with the official `ollama` client's own types."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import ollama
import pytest
from starlette.testclient import TestClient

from exokv.errors import ExokvError
from exokv.prompt import grammar
from exokv.prompt.markers import RAW
from exokv.serve import api
from exokv.serve import ollama as shapes
from exokv.serve.app import Service, build_app
from exokv.serve.tools import ModelTools
from exokv.serve.work import TurnQueue
from tests.stub_client import Replies

ASK = [{"role": "user", "content": "hi"}]
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
TOOLS = ModelTools(
    template=True, start="<tool_call>", end="</tool_call>", parser=lambda body, _: json.loads(body)
)
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}


def chat(doc: dict, **defaults: Any) -> shapes.OllamaCall:
    body = json.dumps({"model": "m", **doc}).encode()
    return shapes.parse_chat(body, {"m"}, api.Defaults(**defaults), api.Limits())


def generate(doc: dict, **defaults: Any) -> shapes.OllamaCall:
    body = json.dumps({"model": "m", **doc}).encode()
    return shapes.parse_generate(body, {"m"}, api.Defaults(**defaults), api.Limits())


HI = [{"role": "user", "content": "hi"}]


# -- requests -------------------------------------------------------------------------


def test_options_are_the_calls_sampling_and_stream_is_on_unless_said() -> None:
    call = chat(
        {
            "messages": ASK,
            "options": {"num_predict": 9, "temperature": 0.5, "top_p": 0.9, "seed": 4},
            "keep_alive": "5m",
        }
    )
    assert (call.max_tokens, call.temperature, call.top_p, call.seed) == (9, 0.5, 0.9, 4)
    assert call.stream and call.name == "m" and call.chat
    call = chat({"messages": ASK, "stream": False, "options": {"stop": ["\n"], "num_predict": -1}})
    assert not call.stream and call.stop == ["\n"] and call.max_tokens == api.Limits().reply_tokens
    assert chat({"messages": ASK}, max_tokens=17).max_tokens == 17  # the server's --max-tokens


def test_runtime_options_and_samplers_set_off_change_nothing_and_are_accepted() -> None:
    options = {"num_ctx": 4096, "num_thread": 8, "num_gpu": 99, "top_k": 0, "repeat_penalty": 1.0}
    assert chat({"messages": ASK, "options": options}).max_tokens == 256


@pytest.mark.parametrize(
    "doc, says",
    [
        ({"format": {"type": "object", "not": {"type": "string"}}}, "not"),
        ({"format": "yaml"}, "format cannot be enforced"),
        ({"options": {"top_k": 40}}, "options.top_k is not supported"),
        ({"options": {"repeat_penalty": 1.1}}, "options.repeat_penalty"),
        ({"options": {"warp_speed": 9}}, "options.warp_speed is not an option"),
        ({"options": {"num_predict": 0}}, "num_predict must be between"),
        ({"options": {"temperature": "hot"}}, "temperature must be a number"),
        ({"think": True}, "think"),
        ({"keep_alive": [1]}, "keep_alive"),
    ],
)
def test_what_cannot_be_applied_is_refused(doc: dict, says: str) -> None:
    for parse in (chat, generate):
        with pytest.raises(api.ApiError) as caught:
            parse({"messages": ASK, "prompt": "hi", **doc})
        assert caught.value.status == 400 and says in caught.value.message
        assert shapes.error_doc(caught.value) == {"error": caught.value.message}


def test_chat_messages_tools_and_the_models_system() -> None:
    call = chat(
        {
            "messages": [
                {"role": "user", "content": "weather?"},
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [{"function": {"name": "f", "arguments": {"a": 1}}}],
                },
                {"role": "tool", "content": "sunny"},
            ],
            "tools": [WEATHER],
        },
        system="sys",
    )
    assert [m["role"] for m in call.messages] == ["system", "user", "assistant", "tool"]
    (made,) = json.loads(call.messages[2]["tool_calls"])
    assert made["function"] == {"name": "f", "arguments": {"a": 1}}
    assert call.tools == [WEATHER] and call.tool_messages
    with pytest.raises(api.ApiError, match="images"):
        chat({"messages": [{"role": "user", "content": "x", "images": ["aGk="]}]})
    with pytest.raises(api.ApiError, match="role"):
        chat({"messages": [{"role": "robot", "content": "x"}]})


def test_generate_templates_the_prompt_or_sends_it_raw() -> None:
    call = generate({"prompt": "hi", "system": "be brief"})
    assert call.messages == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
    ]
    assert not call.chat
    assert generate({"prompt": "hi", "raw": True}).messages == [{"role": RAW, "content": "hi"}]
    for field in ("suffix", "template", "context", "images"):
        with pytest.raises(api.ApiError, match=field):
            generate({"prompt": "hi", field: ["x"]})
    with pytest.raises(api.ApiError, match="raw"):
        generate({"prompt": "hi", "raw": True, "system": "s"})


def test_no_messages_or_no_prompt_loads_the_model() -> None:
    for parse, body in ((chat, {"messages": []}), (generate, {"prompt": ""})):
        with pytest.raises(shapes.Loaded) as caught:
            parse(body)
        doc = shapes.error_doc(caught.value)
        assert caught.value.status == 200 and doc["done"] and doc["done_reason"] == "load"


def test_a_model_without_a_tag_answers_to_latest() -> None:
    assert shapes.names({"smollm2", "builtin:tiny", "/m/x"}) == {
        "smollm2",
        "smollm2:latest",
        "builtin:tiny",
        "/m/x",
        "/m/x:latest",
    }


# -- the app ----------------------------------------------------------------------------


@pytest.fixture
def served() -> Iterator[Callable[..., TestClient]]:
    """start(text, error=None): Starlette's test client of an app over `Replies`, with
    the key "k"."""
    queues: list[TurnQueue] = []

    def start(text: str, error: Exception | None = None) -> TestClient:
        queues.append(TurnQueue(Replies(text, error=error), 4))
        service = Service(
            model="m", names={"m"}, queue=queues[-1], ranks=1, api_key="k", log=lambda _: None
        )
        service.tools = lambda: TOOLS
        return TestClient(build_app(service), headers={"Authorization": "Bearer k"})

    yield start
    for queue in queues:
        queue.close(timeout=1)


def lines(response: Any) -> list[dict[str, Any]]:
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("application/x-ndjson")
    return [json.loads(line) for line in response.text.splitlines()]


def test_a_chat_streams_ndjson_as_ollama_writes_it_and_whole_says_the_same(served) -> None:
    http = served("Hello there, friend.")
    parts = lines(http.post("/api/chat", json={"model": "m", "messages": ASK}))
    read = [ollama.ChatResponse(**p) for p in parts]  # the client's own types
    assert [r.done for r in read] == [False] * (len(read) - 1) + [True]
    assert all(set(p) == {"model", "created_at", "message", "done"} for p in parts[:-1])
    last = read[-1]
    assert last.done_reason == "stop" and (last.prompt_eval_count, last.eval_count) == (30, 7)
    assert last.eval_duration == 250_000_000 and last.prompt_eval_duration == 250_000_000
    assert last.load_duration == 0 and last.total_duration > 0
    said = "".join(r.message.content for r in read)
    whole = http.post("/api/chat", json={"model": "m", "messages": ASK, "stream": False})
    assert ollama.ChatResponse(**whole.json()).message.content == said == "Hello there, friend."
    done = http.post("/api/generate", json={"model": "m", "prompt": "hi", "stream": False})
    assert ollama.GenerateResponse(**done.json()).response == said


def test_a_tool_call_is_ollamas_tool_calls(served) -> None:
    http = served("Sure. " + CALL)
    ask = {"model": "m", "messages": ASK, "tools": [WEATHER]}
    whole = ollama.ChatResponse(**http.post("/api/chat", json={**ask, "stream": False}).json())
    assert whole.message.content == "Sure. " and whole.done_reason == "stop"
    (call,) = whole.message.tool_calls
    assert (call.function.name, dict(call.function.arguments)) == ("get_weather", {"city": "Paris"})
    read = [ollama.ChatResponse(**p) for p in lines(http.post("/api/chat", json=ask))]
    assert [c.function.name for r in read for c in r.message.tool_calls or []] == ["get_weather"]


def test_errors_are_ollamas_and_a_broken_stream_ends_with_one(served) -> None:
    http = served("half", ExokvError("the ranks went away"))
    parts = lines(http.post("/api/chat", json={"model": "m", "messages": ASK}))
    assert "the ranks went away" in parts[-1]["error"] and parts[0]["message"]["content"]
    refused = http.post(
        "/api/chat", json={"model": "m", "messages": ASK}, headers={"Authorization": "Bearer no"}
    )
    assert refused.status_code == 401 and "API key" in refused.json()["error"]
    assert http.post("/api/chat", json={"model": "z", "messages": ASK}).status_code == 404
    loaded = http.post("/api/generate", json={"model": "m"})
    assert loaded.status_code == 200 and loaded.json()["done_reason"] == "load"
    assert http.get("/api/version").json() == {"version": shapes.VERSION}
    unknown = http.post("/api/show", json={"model": "z"})
    assert unknown.status_code == 404 and "'z'" in unknown.json()["error"]
    assert http.post("/api/show", json={"name": "m:latest"}).json()["capabilities"] == [
        "completion",
        "tools",
    ]


def test_a_keepalive_is_an_empty_piece_the_client_reads() -> None:
    call = chat({"messages": ASK})
    line = shapes.Shape("m", call).keepalive()
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    read = ollama.ChatResponse(**json.loads(line))
    assert read.message.content == "" and read.done is False


@pytest.mark.parametrize("value", ["json", {"type": "object", "properties": {"a": {}}}])
def test_format_is_the_replys_grammar(value: Any) -> None:
    for parse in (chat, generate):
        call = parse({"messages": HI, "prompt": "hi", "format": value})
        assert call.grammar == grammar.from_format(value)
    assert chat({"messages": HI}).grammar is None


def test_format_and_tools_together_are_refused() -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {}}}
    with pytest.raises(api.ApiError, match="format and tools"):
        chat({"messages": HI, "format": "json", "tools": [tool]})
