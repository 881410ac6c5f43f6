"""The Responses API and the Ollama API on a real `exokv serve --model builtin:tiny`
(one server for the module, behind --api-key), through the real clients: `openai`'s
`client.responses` and the official `ollama` client."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import jsonschema
import ollama
import openai
import pytest

from tests.chat_helpers import home_with_models
from tests.serve_helpers import MODEL, serving
from tests.test_grammar import PERSON

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

KEY = "sesame"
SYSTEM = "be brief"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, models_dir: Path):
    home = home_with_models(tmp_path_factory.mktemp("clients") / "h", models_dir, link=True)
    with serving(home, "--max-tokens", "10", "--api-key", KEY) as s:
        yield s


def gpt(server) -> openai.OpenAI:
    return server.client(KEY)


def llama(server, key: str = KEY) -> ollama.Client:
    return ollama.Client(host=server.url, headers={"Authorization": f"Bearer {key}"}, timeout=120)


def chat_text(server, messages: list[dict[str, str]], max_tokens: int) -> tuple[str, int]:
    """The chat completion's text and prompt tokens for the same conversation."""
    done = gpt(server).chat.completions.create(
        model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0
    )
    return done.choices[0].message.content, done.usage.prompt_tokens


# -- /v1/responses --------------------------------------------------------------------


def test_a_response_streamed_and_not_is_the_chats_reply(server) -> None:
    ask = "Once upon a time"
    done = gpt(server).responses.create(
        model=MODEL, input=ask, instructions=SYSTEM, max_output_tokens=8
    )
    text, prompt = chat_text(
        server, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": ask}], 8
    )
    assert done.output_text == text and done.usage.input_tokens == prompt
    assert done.usage.output_tokens == 8
    assert (done.status, done.incomplete_details.reason) == ("incomplete", "max_output_tokens")
    events = list(
        gpt(server).responses.create(
            model=MODEL, input=ask, instructions=SYSTEM, max_output_tokens=8, stream=True
        )
    )
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",  # cut by max_output_tokens, as OpenAI ends such a stream
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == text
    final = events[-1].response
    assert final.output_text == text and final.id == events[0].response.id
    assert final.usage.input_tokens_details.cached_tokens > 0  # the same prompt again


def test_previous_response_id_continues_the_conversation_from_the_cache(server) -> None:
    client = gpt(server)
    first = client.responses.create(model=MODEL, input="hello there", instructions=SYSTEM)
    then = client.responses.create(
        model=MODEL, input="tell me more", instructions=SYSTEM, previous_response_id=first.id
    )
    whole = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "hello there"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "tell me more"},
    ]
    # Only the new turn sent: the whole conversation's prompt, served from the cache
    # up to the new message (the first exchange, its reply as the tokens it was made of).
    assert then.usage.input_tokens_details.cached_tokens > first.usage.input_tokens
    text, prompt = chat_text(server, whole, 10)
    assert then.output_text == text and then.usage.input_tokens == prompt
    assert client.responses.retrieve(first.id).output_text == first.output_text
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.create(model=MODEL, input="x", previous_response_id="resp_gone")
    assert caught.value.body["code"] == "previous_response_not_found"


def test_responses_text_format_holds_the_reply_to_a_schema(server) -> None:
    shape = {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}
    done = gpt(server).responses.create(
        model=MODEL,
        input="a person",
        text={"format": shape},
        temperature=1.0,
        max_output_tokens=120,
    )
    jsonschema.validate(json.loads(done.output_text), PERSON)


def test_responses_refuse_in_openais_shape(server) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        gpt(server).responses.create(
            model=MODEL, input="x", text={"format": {"type": "json_schema", "schema": {"not": {}}}}
        )
    assert caught.value.body["param"] == "text.format" and "not" in caught.value.message
    with pytest.raises(openai.AuthenticationError):
        server.client("wrong").responses.create(model=MODEL, input="x")


# -- the Ollama API ---------------------------------------------------------------------


def test_the_ollama_client_lists_shows_and_runs_the_model(server) -> None:
    client = llama(server)
    (listed,) = client.list().models
    assert listed.model == MODEL and listed.size > 0 and listed.details.family
    (loaded,) = client.ps().models
    assert loaded.model == MODEL
    shown = client.show(MODEL)
    assert "completion" in shown.capabilities and shown.details.family == listed.details.family
    version = httpx.get(server.url + "/api/version", headers={"Authorization": f"Bearer {KEY}"})
    assert version.status_code == 200 and version.json()["version"]


def test_ollama_chat_streamed_and_not_gives_the_same_text_as_the_openai_chat(server) -> None:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi there"}]
    options = {"num_predict": 6, "temperature": 0}
    done = llama(server).chat(model=MODEL, messages=messages, options=options)
    assert done.done and done.done_reason == "length" and done.eval_count == 6
    assert done.prompt_eval_count > 0 and done.total_duration > 0
    parts = list(llama(server).chat(model=MODEL, messages=messages, options=options, stream=True))
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    assert "".join(p.message.content for p in parts) == done.message.content
    assert parts[-1].done_reason == "length" and parts[-1].eval_count == 6
    assert chat_text(server, messages, 6)[0] == done.message.content
    said = llama(server).generate(model=MODEL, prompt="hi there", system=SYSTEM, options=options)
    assert said.response == done.message.content  # the same prompt, templated alike


def test_ollama_format_holds_the_reply_to_a_schema_or_to_json(server) -> None:
    ask = [{"role": "user", "content": "a person"}]
    for seed in (0, 3):
        options = {"num_predict": 120, "temperature": 1.0, "seed": seed}
        done = llama(server).chat(model=MODEL, messages=ask, format=PERSON, options=options)
        jsonschema.validate(json.loads(done.message.content), PERSON)
    said = llama(server).generate(
        model=MODEL, prompt="x", format="json", options={"num_predict": 120}
    )
    assert said.done_reason == "stop" and isinstance(json.loads(said.response), dict)


def test_ollama_refuses_in_its_own_shape(server) -> None:
    ask = [{"role": "user", "content": "x"}]
    with pytest.raises(ollama.ResponseError) as caught:
        llama(server).chat(model=MODEL, messages=ask, format={"not": {"type": "string"}})
    assert caught.value.status_code == 400 and "not" in caught.value.error
    with pytest.raises(ollama.ResponseError) as caught:
        llama(server, "wrong").chat(model=MODEL, messages=ask)
    assert caught.value.status_code == 401
    with pytest.raises(ollama.ResponseError) as caught:
        llama(server).chat(model="another", messages=ask)
    assert caught.value.status_code == 404
    body = json.dumps({"model": MODEL, "prompt": "x", "options": {"top_k": 40}})
    refused = httpx.post(
        server.url + "/api/generate", content=body, headers={"Authorization": f"Bearer {KEY}"}
    )
    assert refused.status_code == 400 and "top_k" in refused.json()["error"]
