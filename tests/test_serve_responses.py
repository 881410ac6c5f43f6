"""The Responses API's parts, in this process: input items read into chat messages,
what is refused, the bounded store behind previous_response_id, and the app's replies
(whole and streamed, with a tool call) read by the `openai` client over Starlette's
test client and a client that replies a given text."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import openai
import pytest
from starlette.testclient import TestClient

from exokv.core.records import TurnRequest, TurnResult
from exokv.errors import ExokvError
from exokv.serve import api, responses
from exokv.serve.app import Service, build_app
from exokv.serve.tools import ModelTools
from exokv.serve.work import TurnQueue
from tests.stub_client import Replies

CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
TOOLS = ModelTools(
    template=True, start="<tool_call>", end="</tool_call>", parser=lambda body, _: json.loads(body)
)
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}


def parse(doc: dict, store: responses.ResponseStore | None = None, **defaults) -> Any:
    return responses.parse(
        json.dumps(doc).encode(),
        {"m"},
        api.Defaults(**defaults),
        api.Limits(),
        store if store is not None else responses.ResponseStore(),
    )


# -- input items ----------------------------------------------------------------------


def test_a_string_input_is_the_users_message_and_instructions_the_system() -> None:
    call = parse({"input": "hi", "instructions": "be brief", "max_output_tokens": 7})
    assert call.messages == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
    ]
    assert (call.max_tokens, call.history) == (7, [{"role": "user", "content": "hi"}])
    # No instructions: the model's own system prompt, as for chat requests.
    assert parse({"input": "hi"}, system="sys").messages[0] == {"role": "system", "content": "sys"}


def test_items_become_the_chats_messages_calls_and_results() -> None:
    call = parse(
        {
            "input": [
                {"role": "developer", "content": [{"type": "input_text", "text": "rules"}]},
                {"type": "message", "role": "user", "content": "weather?"},
                {"type": "reasoning", "summary": []},
                {"role": "assistant", "content": [{"type": "output_text", "text": "Let me see."}]},
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"a": 1}'},
                {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
                {"type": "function_call_output", "call_id": "c2", "output": "warm"},
            ]
        }
    )
    roles = [m["role"] for m in call.messages]
    assert roles == ["system", "user", "assistant", "tool", "tool"]
    assistant = call.messages[2]
    assert assistant["content"] == "Let me see."
    calls = json.loads(assistant["tool_calls"])
    assert [(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("c1", "f", {"a": 1}),
        ("c2", "g", {}),
    ]
    assert call.messages[3] == {"role": "tool", "tool_call_id": "c1", "content": "sunny"}
    assert call.tool_messages


def test_a_call_with_no_assistant_message_before_it_gets_one_of_its_own() -> None:
    call = parse(
        {
            "input": [
                {"role": "user", "content": "go"},
                {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c", "output": "done"},
            ]
        }
    )
    assert [m["role"] for m in call.messages] == ["user", "assistant", "tool"]
    assert call.messages[1]["content"] == ""


@pytest.mark.parametrize(
    "doc, says",
    [
        ({"input": []}, "input must be"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input_image"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "item_reference"),
        ({"input": [{"role": "assistant", "content": "x"}]}, "last input item"),
        ({"input": [{"type": "function_call", "name": "f", "arguments": "{"}]}, "JSON"),
        ({"input": "x", "background": True}, "background"),
        ({"input": "x", "text": {"format": {"type": "json_schema"}}}, "needs its schema"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "schema": {"not": {}}}}}, "not"),
        ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text.format"),
        ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning"),
        ({"input": "x", "reasoning": "high"}, "reasoning"),
        ({"input": "x", "text": {"format": "json"}}, "text.format"),
        ({"input": "x", "text": "json"}, "text.format"),
        ({"input": "x", "truncation": "auto"}, "truncation"),
        ({"input": "x", "top_logprobs": 3}, "top_logprobs"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "'web_search' tools"),
        ({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "z"}}, "z"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "x", "instructions": 3}, "instructions"),
    ],
)
def test_what_cannot_be_served_is_a_400(doc: dict, says: str) -> None:
    with pytest.raises(api.ApiError) as caught:
        parse(doc)
    assert caught.value.status == 400 and says in caught.value.message


def test_what_changes_nothing_or_says_off_is_accepted() -> None:
    call = parse(
        {
            "input": "x",
            "store": False,
            "reasoning": None,
            "text": {"format": {"type": "text"}, "verbosity": "medium"},
            "truncation": "disabled",
            "background": False,
            "prompt_cache_key": "k",
            "include": [],
            "parallel_tool_calls": False,
            "metadata": {"k": "v"},
        }
    )
    assert (call.store, call.parallel, call.metadata) == (False, False, {"k": "v"})


def test_function_tools_are_rendered_as_the_chats() -> None:
    call = parse({"input": "x", "tools": [WEATHER], "tool_choice": "required"})
    assert call.forced and call.tools[0]["function"]["name"] == "get_weather"
    assert call.tools[0]["function"]["parameters"] == WEATHER["parameters"]
    named = parse(
        {
            "input": "x",
            "tools": [WEATHER],
            "tool_choice": {"type": "function", "name": "get_weather"},
        }
    )
    assert named.forced_name == "get_weather"
    assert parse({"input": "x", "tools": [WEATHER], "tool_choice": "none"}).tools == []


# -- the store ------------------------------------------------------------------------


def test_the_store_continues_a_conversation_and_forgets_the_oldest() -> None:
    store = responses.ResponseStore(items=2)
    store.put("a", [{"role": "user", "content": "1"}, {"role": "assistant", "content": "2"}], {})
    call = parse({"input": "3", "previous_response_id": "a"}, store)
    assert [m["content"] for m in call.messages] == ["1", "2", "3"]
    store.put("b", [], {})
    store.messages("a")  # used: the newest now
    store.put("c", [], {})
    assert len(store) == 2 and store.messages("a")
    with pytest.raises(api.ApiError) as caught:
        store.messages("b")
    assert (caught.value.status, caught.value.code) == (404, "previous_response_not_found")


def test_the_store_is_bounded_in_characters_too() -> None:
    store = responses.ResponseStore(chars=10)
    store.put("a", [{"role": "user", "content": "x" * 8}], {})
    store.put("b", [{"role": "user", "content": "y" * 8}], {})
    assert len(store) == 1 and store.messages("b")


# -- the app, read by the openai client -------------------------------------------------


@pytest.fixture
def served() -> Iterator[Callable[..., tuple[openai.OpenAI, Replies]]]:
    """start(text): an openai client of an in-process app over `Replies(text)`."""
    queues: list[TurnQueue] = []

    def start(text: str, finish: str = "stop") -> tuple[openai.OpenAI, Replies]:
        stub = Replies(text, finish)
        queues.append(TurnQueue(stub, 4))
        service = Service(model="m", names={"m"}, queue=queues[-1], ranks=1, log=lambda _: None)
        service.tools = lambda: TOOLS
        http = TestClient(build_app(service))
        return openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http), stub

    yield start
    for queue in queues:
        queue.close(timeout=1)


def test_a_tool_call_is_a_function_call_item_and_its_output_goes_back(served) -> None:
    client, stub = served("Sure. " + CALL)
    done = client.responses.create(model="m", input="weather in Paris?", tools=[WEATHER])
    assert done.status == "completed" and [o.type for o in done.output] == [
        "message",
        "function_call",
    ]
    assert done.output_text == "Sure. "
    call = done.output[1]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert call.call_id.startswith("call_") and done.usage.input_tokens_details.cached_tokens == 20
    assert client.responses.retrieve(done.id).output[1].call_id == call.call_id
    client.responses.create(
        model="m",
        previous_response_id=done.id,
        tools=[WEATHER],
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
    )
    messages = stub.requests[-1].messages
    assert [m["role"] for m in messages][-3:] == ["user", "assistant", "tool"]
    (made,) = json.loads(messages[-2]["tool_calls"])
    assert made["id"] == call.call_id and made["function"]["arguments"] == {"city": "Paris"}
    assert messages[-1]["tool_call_id"] == call.call_id


def test_a_streamed_tool_call_has_its_items_events(served) -> None:
    client, _ = served("Sure. " + CALL)
    with client.responses.stream(model="m", input="weather?", tools=[WEATHER]) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[-6:] == [
        "response.output_item.done",  # the message, closed by the call
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert final.output_text == "Sure. " and final.output[1].name == "get_weather"


def test_a_stream_that_breaks_ends_with_response_failed(served) -> None:
    client, stub = served("never said")

    def fail(request: TurnRequest, on_text=None, on_progress=None) -> TurnResult:
        if on_text is not None:
            on_text("half")
        raise ExokvError("the ranks went away")

    stub.turn = fail
    events = list(client.responses.create(model="m", input="x", stream=True))
    assert [e.type for e in events][-2:] == ["error", "response.failed"]
    assert "the ranks went away" in events[-2].message
    assert events[-1].response.status == "failed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
