"""Structured output, tools on a template without them, and logprobs, against a real
`exokv serve --model builtin:tiny` (random weights) through the openai client; and
the same constrained replies from two pipeline ranks."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import openai
import pytest

from tests.chat_helpers import home_with_models
from tests.serve_helpers import serving
from tests.test_grammar import PERSON, WEATHER

ASK = [{"role": "user", "content": "Tell me about a person"}]
STRICT = {
    "type": "json_schema",
    "json_schema": {"name": "person", "schema": PERSON, "strict": True},
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, models_dir: Path):
    home = home_with_models(tmp_path_factory.mktemp("structured") / "h", models_dir, link=True)
    with serving(home, "--starting-port", "32520") as s:
        yield s


def _person(client: openai.OpenAI, **fields) -> str:
    done = client.chat.completions.create(
        model="builtin:tiny", messages=ASK, max_tokens=120, response_format=STRICT, **fields
    )
    assert done.choices[0].finish_reason == "stop"
    return done.choices[0].message.content


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_strict_schema_holds_at_temperature_one_and_json_object_parses(server) -> None:
    client = server.client()
    for seed in (0, 1, 7):
        jsonschema.validate(json.loads(_person(client, temperature=1.0, seed=seed)), PERSON)
    jsonschema.validate(json.loads(_person(client, temperature=1.0)), PERSON)  # in a batch
    done = client.chat.completions.create(
        model="builtin:tiny",
        messages=[{"role": "user", "content": "x"}],
        max_tokens=120,
        response_format={"type": "json_object"},
    )
    assert isinstance(json.loads(done.choices[0].message.content), dict)
    with pytest.raises(openai.BadRequestError, match=r'Unimplemented keys: \["not"\]'):
        bad = {"type": "json_schema", "json_schema": {"name": "n", "schema": {"not": {}}}}
        client.chat.completions.create(model="builtin:tiny", messages=ASK, response_format=bad)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_required_tool_call_on_a_template_without_tools(server) -> None:
    client = server.client()
    done = client.chat.completions.create(
        model="builtin:tiny",
        messages=[{"role": "user", "content": "Weather in Oslo?"}],
        max_tokens=120,
        temperature=1.0,
        tools=[WEATHER],
        tool_choice="required",
    )
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    stream = client.chat.completions.create(
        model="builtin:tiny",
        messages=[{"role": "user", "content": "Weather in Oslo?"}],
        max_tokens=120,
        tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        parallel_tool_calls=False,
        stream=True,
    )
    chunks = [c for c in stream if c.choices]
    calls = [t for c in chunks for t in c.choices[0].delta.tool_calls or []]
    assert len(calls) == 1 and chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_logprobs_at_temperature_zero_whole_and_streamed(server) -> None:
    client = server.client()
    ask = dict(model="builtin:tiny", messages=ASK, max_tokens=12, temperature=0)
    done = client.chat.completions.create(**ask, logprobs=True, top_logprobs=3)
    entries = done.choices[0].logprobs.content
    assert len(entries) == done.usage.completion_tokens
    for entry in entries:
        assert len(entry.top_logprobs) == 3
        assert entry.token == entry.top_logprobs[0].token  # the chosen token, the most likely
        assert entry.logprob == max(t.logprob for t in entry.top_logprobs)
    streamed = []
    for c in client.chat.completions.create(**ask, logprobs=True, top_logprobs=3, stream=True):
        if c.choices and c.choices[0].logprobs:
            streamed += c.choices[0].logprobs.content
    assert [e.token for e in streamed] == [e.token for e in entries]
    legacy = client.completions.create(
        model="builtin:tiny", prompt="Once upon", max_tokens=5, temperature=0, logprobs=2
    )
    lp = legacy.choices[0].logprobs
    assert len(lp.tokens) == legacy.usage.completion_tokens == len(lp.top_logprobs)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_pipeline_ranks_give_the_same_constrained_replies(
    server, tmp_path: Path, models_dir: Path
) -> None:
    one = server.client()
    seeded = _person(one, temperature=1.0, seed=3)  # alone: mlx-lm's generate_step
    batched = _person(one, temperature=0.0)  # a batch of one: the batch's sampler
    home = home_with_models(tmp_path / "h", models_dir, link=True)
    ranks = ("-n", "2", "--parallel", "pipeline", "--starting-port", "32530")
    with serving(home, *ranks) as two:
        client = two.client()
        assert _person(client, temperature=1.0, seed=3) == seeded
        assert _person(client, temperature=0.0) == batched
