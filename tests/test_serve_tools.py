"""OpenAI tool calling on `exokv serve`: tools rendered by the model's own chat template,
a tool's result accepted, a tool call in the reply parsed (mlx-lm's parser) and
streamed as OpenAI streams it; a forced call the template cannot make goes in the
generic format (tests/test_serve_structured.py has a template without tools).

The model is builtin:tiny with a tools template (Hermes-style, which mlx-lm reads with
its json_tools parser). A random model calls no tool by itself, so the parsing and
streaming tests run the app in this process over a client that replies a given text.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import anthropic
import openai
import pytest

from exokv.prompt.markers import PREFIX
from exokv.serve.tools import ModelTools, ToolText, model_tools
from tests.chat_helpers import home_with_models
from tests.serve_helpers import InProcess, raw, serving
from tests.stub_client import Replies

TOOLS_TEMPLATE = (
    "{%- if tools -%}<|im_start|>system\nYou may call these tools:\n<tools>\n"
    "{%- for tool in tools %}{{ tool | tojson }}\n{% endfor -%}</tools>\n"
    'Answer a call as <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>\n'
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message.role == 'assistant' and message.tool_calls -%}"
    "<|im_start|>assistant\n{{ message.content or '' }}"
    "{%- for tool_call in message.tool_calls -%}{%- set tool_call = tool_call.function -%}"
    '<tool_call>\n{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}'
    "\n</tool_call>{%- endfor -%}<|im_end|>\n"
    "{%- elif message.role == 'tool' -%}"
    "<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response><|im_end|>\n"
    "{%- else -%}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_start|>assistant\n{%- endif -%}"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def tools_model(root: Path, models_dir: Path) -> Path:
    """builtin:tiny's checkpoint with a chat template that reads `tools`."""
    out = root / "tiny-tools"
    out.mkdir(parents=True)
    for item in (models_dir / "tiny").iterdir():
        if item.name == "exokv_builtin.json":
            continue
        if item.suffix == ".safetensors":
            (out / item.name).symlink_to(item)
        else:
            shutil.copy(item, out / item.name)
    config = json.loads((out / "tokenizer_config.json").read_text())
    config["chat_template"] = TOOLS_TEMPLATE
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory, models_dir: Path) -> Path:
    return tools_model(tmp_path_factory.mktemp("tools-model"), models_dir)


# -- the model's tools and the reply's calls ---------------------------------------


def test_the_model_with_a_tools_template_has_mlx_lms_json_parser(model: Path) -> None:
    tools = model_tools(str(model))
    assert tools.template and (tools.start, tools.end) == ("<tool_call>", "</tool_call>")


def test_the_tools_are_read_from_the_template_the_ranks_render_with(models_dir: Path) -> None:
    tiny = str(models_dir / "tiny")  # its own template has no tools; --chat-template's has
    assert not model_tools(tiny).template
    assert model_tools(tiny, TOOLS_TEMPLATE).template


@pytest.mark.parametrize("cut", range(0, len(CALL) + 1, 7))
def test_a_call_is_cut_out_of_the_text_however_it_streams(model: Path, cut: int) -> None:
    reader = ToolText(model_tools(str(model)), [WEATHER])
    text = "Let me look. " + CALL + " done"
    said, calls = "", []
    for piece in (text[: 13 + cut], text[13 + cut :]):
        out, new = reader.feed(piece)
        said, calls = said + out, calls + new
    out, new = reader.flush()
    said, calls = said + out, calls + new
    assert said == "Let me look.  done"
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}


def test_text_the_parser_cannot_read_stays_text(model: Path) -> None:
    reader = ToolText(model_tools(str(model)), [WEATHER])
    out, calls = reader.feed("a <tool_call>not json</tool_call> b")
    assert (out, calls) == ("a <tool_call>not json</tool_call> b", [])


# -- parsed and streamed through the real client -------------------------------------


@pytest.fixture
def forced(model: Path):
    """An in-process server over `Replies`; yields (start(text) -> openai client)."""
    servers = InProcess()
    tools = model_tools(str(model))

    stubs: list[Replies] = []

    def start(text: str, model_tools: ModelTools | None = tools) -> str:
        stubs.append(Replies(text))
        port = servers.start(stubs[-1], tools=model_tools, with_tools=True)
        return f"http://127.0.0.1:{port}"

    start.stubs = stubs  # each server's client: the turns it was asked for
    yield start
    servers.close()


ASK = [{"role": "user", "content": "weather in Paris?"}]
CLAUDE_WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": WEATHER["function"]["parameters"],
}


def gpt(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)


def claude(url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key="x", max_retries=0, timeout=120)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_tool_call_is_returned_as_tool_calls(forced) -> None:
    client = gpt(forced("Sure. " + CALL))
    done = client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER])
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Sure. "
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_tool_call_is_streamed_as_openai_streams_it(forced) -> None:
    client = gpt(forced("Sure. " + CALL + CALL.replace("Paris", "Rome")))
    chunks = list(
        client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER], stream=True)
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Sure. "
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert [d.index for d in deltas] == [0, 1]
    cities = [json.loads(d.function.arguments)["city"] for d in deltas]
    assert cities == ["Paris", "Rome"]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_without_tools_the_same_text_is_text(forced) -> None:
    client = gpt(forced(CALL))
    done = client.chat.completions.create(model="m", messages=ASK)
    assert done.choices[0].message.content == CALL
    assert done.choices[0].finish_reason == "stop"


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_anthropics_tool_use_blocks_whole_and_streamed(forced) -> None:
    url = forced("Sure. " + CALL)
    done = claude(url).messages.create(
        model="m", max_tokens=50, messages=ASK, tools=[CLAUDE_WEATHER]
    )
    assert done.stop_reason == "tool_use"
    text, use = done.content
    assert (text.type, text.text) == ("text", "Sure. ")
    assert (use.type, use.name, use.input) == ("tool_use", "get_weather", {"city": "Paris"})
    assert use.id.startswith("toolu_")
    with claude(url).messages.stream(
        model="m", max_tokens=50, messages=ASK, tools=[CLAUDE_WEATHER]
    ) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    assert [b.type for b in final.content] == ["text", "tool_use"]
    assert final.content[0].text == "Sure. "
    assert final.content[1].input == {"city": "Paris"}


# -- tool_choice: a call forced, of any tool or of one named -------------------------

CLOCK = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
}


def test_the_opening_of_a_call_is_read_from_the_template(model: Path) -> None:
    tools = model_tools(str(model))
    assert tools.opening(None) == '\n<tool_call>\n{"name": "'
    assert tools.opening("get_weather") == '\n<tool_call>\n{"name": "get_weather", "arguments": {'
    # Held by a grammar, a named call opens before its arguments' brace, and the rest of
    # the call is what the template writes after the arguments, up to the end marker.
    assert (
        tools.held_opening("get_weather") == '\n<tool_call>\n{"name": "get_weather", "arguments": '
    )
    assert tools.held_opening(None) == tools.opening(None)
    assert tools.tail == "}\n</tool_call>"


def test_a_forced_calls_arguments_and_end_are_held_by_a_grammar(model: Path, tiny) -> None:
    from exokv.rank.constrain import Constraint, vocab_size  # why: the rank's sampler, here

    tools = model_tools(str(model))
    weather = {**WEATHER["function"]}
    weather["parameters"] = {**weather["parameters"], "additionalProperties": False}
    offered = [CLOCK, {"type": "function", "function": weather}]
    tiny_model, tokenizer = tiny

    def walk(name: str | None, text: str) -> bool:
        held = tools.call_grammar(offered, name)
        c = Constraint(held, tokenizer, vocab_size(tiny_model, tokenizer), [2])
        for token in tokenizer._tokenizer.encode(text, add_special_tokens=False):
            if not c.allowed()[token]:
                return False
            c.advance(token)
        return bool(c.allowed()[2])  # may end here

    assert walk("get_weather", '{"city": "Paris"}}\n</tool_call>')
    assert not walk("get_weather", '{"town": "Paris"}}\n</tool_call>')
    assert not walk("get_weather", '{"city": "Paris"}} and more')
    assert walk(None, 'get_time", "arguments": {}}\n</tool_call>')
    assert not walk(None, 'get_weather", "arguments": {}}\n</tool_call>')  # city required


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_named_tool_choice_starts_the_reply_as_that_call(forced) -> None:
    url = forced('{"city": "Paris"}}\n</tool_call>')  # the model continues the opening
    named = {"type": "function", "function": {"name": "get_weather"}}
    done = gpt(url).chat.completions.create(
        model="m", messages=ASK, tools=[CLOCK, WEATHER], tool_choice=named
    )
    (call,) = done.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert done.choices[0].finish_reason == "tool_calls" and not done.choices[0].message.content
    (request,) = forced.stubs[-1].requests
    assert request.messages[-1] == {
        "role": PREFIX,
        "content": '\n<tool_call>\n{"name": "get_weather", "arguments": ',
    }
    assert request.grammar is not None  # the arguments held to the tool's parameters
    offered = json.loads(request.messages[0]["content"])
    assert [t["function"]["name"] for t in offered] == ["get_weather"]  # only the named one


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_required_and_anthropics_any_and_tool_force_a_call_streamed_too(forced) -> None:
    url = forced('get_time", "arguments": {}}\n</tool_call>')  # the model chose the name
    chunks = list(
        gpt(url).chat.completions.create(
            model="m", messages=ASK, tools=[CLOCK, WEATHER], tool_choice="required", stream=True
        )
    )
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert [d.function.name for d in deltas] == ["get_time"]
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    clock = {"name": "get_time", "input_schema": {"type": "object", "properties": {}}}
    done = claude(url).messages.create(
        model="m",
        max_tokens=50,
        messages=ASK,
        tools=[clock, CLAUDE_WEATHER],
        tool_choice={"type": "any"},
    )
    assert done.stop_reason == "tool_use"
    assert [(b.type, b.name) for b in done.content] == [("tool_use", "get_time")]
    url = forced('{"city": "Oslo"}}\n</tool_call>')
    with claude(url).messages.stream(
        model="m",
        max_tokens=50,
        messages=ASK,
        tools=[clock, CLAUDE_WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
    ) as stream:
        final = stream.get_final_message()
    assert [(b.type, b.input) for b in final.content] == [("tool_use", {"city": "Oslo"})]


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_call_that_cannot_be_forced_is_a_clear_400(forced, model: Path) -> None:
    url = forced("x")
    named = {"type": "function", "function": {"name": "get_wether"}}
    body = {"messages": ASK, "tools": [WEATHER], "tool_choice": named}
    status, _, doc = raw(url + "/v1/chat/completions", json.dumps(body).encode())
    assert status == 400 and "'get_wether', which is not among the tools" in doc["error"]["message"]
    body["tool_choice"] = {"type": "tool"}
    assert raw(url + "/v1/chat/completions", json.dumps(body).encode())[0] == 400
    # A parser the template does not show a call for: the call is forced in the
    # generic format instead (the tools in the system prompt, its JSON by a grammar).
    unknown = ModelTools(template=True, start="<call>", end="</call>", parser=lambda *_: {})
    reply = {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}}]}
    url = forced(json.dumps(reply), unknown)
    body = {"messages": ASK, "tools": [WEATHER], "tool_choice": "required"}
    status, _, doc = raw(url + "/v1/chat/completions", json.dumps(body).encode())
    assert status == 200 and doc["choices"][0]["finish_reason"] == "tool_calls", doc
    (call,) = doc["choices"][0]["message"]["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"city": "Oslo"}
    (turn,) = forced.stubs[-1].requests
    assert turn.grammar is not None and "get_weather" in turn.messages[0]["content"]


# -- rendered by the model's template, on the real model -----------------------------


@pytest.fixture(scope="module")
def tools_server(tmp_path_factory: pytest.TempPathFactory, models_dir: Path, model: Path):
    home = home_with_models(tmp_path_factory.mktemp("tools") / "h", models_dir, link=True)
    with serving(home, "--model", str(model), "--max-tokens", "4") as s:
        yield s


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tools_are_rendered_and_a_tool_result_is_accepted(tools_server, model: Path) -> None:
    client = tools_server.client()
    plain = client.chat.completions.create(model=model.name, messages=ASK)
    with_tools = client.chat.completions.create(model=model.name, messages=ASK, tools=[WEATHER])
    grown = with_tools.usage.prompt_tokens - plain.usage.prompt_tokens
    assert grown > len(json.dumps(WEATHER)) // 4  # the tools' text is in the prompt
    none = client.chat.completions.create(
        model=model.name, messages=ASK, tools=[WEATHER], tool_choice="none"
    )
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    result = client.chat.completions.create(
        model=model.name,
        messages=[
            *ASK,
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
        ],
        tools=[WEATHER],
    )
    assert result.choices[0].message.content is not None
    assert result.usage.prompt_tokens > with_tools.usage.prompt_tokens + 10
    assert result.usage.prompt_tokens_details.cached_tokens > 0  # the tools' prefix


def prompt(used: anthropic.types.Usage) -> int:
    """The prompt's tokens: Anthropic's usage cuts it in three."""
    read, created = used.cache_read_input_tokens or 0, used.cache_creation_input_tokens or 0
    return used.input_tokens + read + created


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_anthropic_tools_and_a_tool_result_are_rendered(tools_server, model: Path) -> None:
    client = claude(tools_server.url)
    plain = client.messages.create(model=model.name, max_tokens=4, messages=ASK)
    with_tools = client.messages.create(
        model=model.name, max_tokens=4, messages=ASK, tools=[CLAUDE_WEATHER]
    )
    assert prompt(with_tools.usage) > prompt(plain.usage) + 20
    counted = client.messages.count_tokens(model=model.name, messages=ASK, tools=[CLAUDE_WEATHER])
    assert counted.input_tokens == prompt(with_tools.usage)
    result = client.messages.create(
        model=model.name,
        max_tokens=4,
        tools=[CLAUDE_WEATHER],
        messages=[
            *ASK,
            {
                "role": "assistant",
                "content": [
                    {
                        "type": "tool_use",
                        "id": "t1",
                        "name": "get_weather",
                        "input": {"city": "Paris"},
                    }
                ],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sunny"}],
            },
        ],
    )
    assert result.usage.cache_read_input_tokens > 0
    assert result.content


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_forced_call_runs_on_the_model_with_its_opening_in_the_prompt(
    tools_server, model: Path
) -> None:
    client = tools_server.client()
    auto = client.chat.completions.create(model=model.name, messages=ASK, tools=[WEATHER])
    named = {"type": "function", "function": {"name": "get_weather"}}
    forced = client.chat.completions.create(
        model=model.name, messages=ASK, tools=[CLOCK, WEATHER], tool_choice=named
    )
    # The other tool is not offered, and the call's opening is in the prompt.
    assert forced.usage.prompt_tokens > auto.usage.prompt_tokens
    assert forced.usage.completion_tokens > 0
    ask = dict(
        model=model.name,
        messages=ASK,
        tools=[CLAUDE_WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
    )
    counted = claude(tools_server.url).messages.count_tokens(**ask)
    done = claude(tools_server.url).messages.create(max_tokens=4, **ask)
    assert counted.input_tokens == prompt(done.usage) == forced.usage.prompt_tokens
