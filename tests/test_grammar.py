"""Structured output, generic tools and logprobs (issue 44), without a server.

Schemas become llguidance grammars (exokv.prompt.grammar); a `Constraint` masks the
next token on builtin:tiny's tokenizer (exokv.rank.constrain); the engine enforces a
grammar alone and in a batch (per row), and reports logprobs from the logits it
samples from. The request side (exokv.serve.structured, generic_tools, api) is pure.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import jsonschema
import mlx.core as mx
import numpy as np
import pytest

from exokv.core.records import TurnRequest, TurnResult
from exokv.prompt import grammar
from exokv.rank import constrain
from exokv.rank.batch import run_batch
from exokv.rank.engine import Engine
from exokv.serve import anthropic, api, completions, generic_tools, structured
from exokv.serve.errors import ApiError
from exokv.serve.tools import ModelTools

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user"]},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "ok"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "unit": {"enum": ["c", "f"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "Tell me about a person"}]


# -- schemas into grammars ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("schema", "keyword"),
    [
        ({"not": {"type": "string"}}, "not"),
        ({"type": "object", "if": {}, "then": {}}, "if"),
        ({"type": "array", "uniqueItems": True}, "uniqueItems"),
        ({"type": "bogus"}, "bogus"),
    ],
)
def test_a_schema_it_cannot_enforce_names_the_keyword(schema: dict, keyword: str) -> None:
    with pytest.raises(grammar.GrammarError, match=keyword):
        grammar.from_schema(schema)


def test_the_format_hook_takes_json_or_a_schema_and_nothing_else() -> None:
    assert grammar.from_format("json") == grammar.any_object()
    assert grammar.from_format(PERSON) == grammar.from_schema(PERSON)
    for bad in ("xml", ["json"], 3, None):
        with pytest.raises(grammar.GrammarError, match="JSON schema"):
            grammar.from_format(bad)


def test_the_generic_call_schema_admits_calls_of_the_tools_only() -> None:
    schema = grammar.call_schema([WEATHER], parallel=False)
    call = {"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}
    jsonschema.validate({"tool_calls": [call]}, schema)
    for wrong in (
        {"tool_calls": []},  # a forced reply calls something
        {"tool_calls": [call, call]},  # parallel_tool_calls false: one call
        {"tool_calls": [{**call, "name": "other"}]},
        {"tool_calls": [{**call, "arguments": {"city": "Oslo"}}]},
        {"response": "hi"},
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, schema)
    jsonschema.validate({"tool_calls": [call, call]}, grammar.call_schema([WEATHER], True))


# -- the mask on builtin:tiny's tokenizer ------------------------------------------------


def _constraint(tiny, schema: dict) -> constrain.Constraint:
    model, tokenizer = tiny
    vocab = constrain.vocab_size(model, tokenizer)
    return constrain.Constraint(grammar.from_schema(schema), tokenizer, vocab, [2])


def test_the_mask_admits_a_valid_document_token_by_token_and_then_only_the_end(tiny) -> None:
    _, tokenizer = tiny
    c = _constraint(tiny, PERSON)
    text = json.dumps({"name": "Ada", "age": 36, "role": "user", "ok": True}, separators=(",", ":"))
    for token in tokenizer._tokenizer.encode(text, add_special_tokens=False):
        allowed = c.allowed()
        assert allowed[token] and not allowed.all()
        c.advance(token)
    assert np.flatnonzero(c.allowed()).tolist() == [2]  # the end of turn alone


def test_the_mask_forbids_what_the_schema_does_not_allow(tiny) -> None:
    _, tokenizer = tiny
    c = _constraint(tiny, PERSON)
    allowed = c.allowed()
    letter = tokenizer._tokenizer.encode("a", add_special_tokens=False)[0]
    brace = tokenizer._tokenizer.encode("{", add_special_tokens=False)[0]
    assert allowed[brace] and not allowed[letter] and not allowed[2]


def test_masked_logits_put_forbidden_tokens_at_minus_infinity() -> None:
    logits = mx.zeros((2, 6))
    out = constrain.masked(logits, [np.array([True, False, True, False]), None])
    row = out[0].tolist()
    assert row[:4] == [0.0, -np.inf, 0.0, -np.inf] and row[4:] == [-np.inf, -np.inf]
    assert out[1].tolist() == [0.0] * 6  # an unconstrained row is left alone


def test_top_logprobs_are_the_most_likely_first() -> None:
    logprobs = mx.log(mx.array([0.1, 0.5, 0.15, 0.25]))
    chosen, ids, values = constrain.top_logprobs(logprobs, 2, 3)
    assert ids == [1, 3, 2]
    assert values == sorted(values, reverse=True)
    assert chosen == pytest.approx(np.log(0.15), abs=1e-6)


# -- the engine: a constrained reply alone and in a batch; logprobs -----------------------


def _valid(reply: str, schema: dict) -> None:
    jsonschema.validate(json.loads(reply), schema)


def test_a_constrained_reply_is_valid_at_temperature_one_for_any_seed(tiny) -> None:
    model, tokenizer = tiny
    engine = Engine(model, tokenizer)
    for seed in range(3):
        request = TurnRequest(
            session="s",
            messages=ASK,
            max_tokens=120,
            temp=1.0,
            sample_seed=seed,
            grammar=grammar.from_schema(PERSON),
        )
        result = engine.turn(request)
        assert result.finish_reason == "stop", result.reply
        _valid(result.reply, PERSON)
        assert engine.speculation == "a constrained reply decodes one token at a time"


def test_each_batch_row_keeps_its_own_grammar_and_logprobs(tiny) -> None:
    model, tokenizer = tiny
    engine = Engine(model, tokenizer)
    calls = grammar.generic_tools([WEATHER], forced=True, parallel=False)
    requests = [
        TurnRequest(session="a", messages=ASK, max_tokens=120, temp=1.0, grammar=calls),
        TurnRequest(session="b", messages=ASK, max_tokens=8, logprobs=3),
        TurnRequest(session="c", messages=ASK, max_tokens=120, grammar=grammar.from_schema(PERSON)),
    ]
    outcomes = run_batch(engine, requests)
    assert all(o.batch == 3 for o in outcomes)  # decoded together
    call, free, person = (o.result for o in outcomes)
    _valid(call.reply, grammar.call_schema([WEATHER], parallel=False))
    _valid(person.reply, PERSON)
    assert call.logprobs is None and len(free.logprobs) == free.generated_tokens
    # The same request alone gives the same tokens and logprobs (temperature 0).
    alone = engine.turn(requests[1])
    assert alone.reply == free.reply
    assert [e[0] for e in alone.logprobs] == [e[0] for e in free.logprobs]
    for (_, lp, top), (_, lp2, _) in zip(alone.logprobs, free.logprobs, strict=True):
        assert lp == pytest.approx(lp2, abs=1e-3)
        assert lp == top[0][1] and len(top) == 3  # greedy: the most likely token


# -- the request side ----------------------------------------------------------------------


def _chat(**fields) -> api.ChatCall:
    body = json.dumps({"messages": ASK, **fields}).encode()
    return api.parse_chat(body, {"m"}, api.Defaults(), api.Limits())


def test_response_format_becomes_the_calls_grammar_or_a_400_naming_the_keyword() -> None:
    schema = {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON, "strict": True}}
    assert _chat(response_format=schema).grammar == grammar.from_schema(PERSON)
    assert _chat(response_format={"type": "json_object"}).grammar == grammar.any_object()
    assert _chat(response_format={"type": "text"}).grammar is None
    unsupported = {"type": "json_schema", "json_schema": {"schema": {"not": {}}}}
    cases = [
        ({"response_format": unsupported}, '["not"]'),
        ({"response_format": {"type": "yaml"}}, "json_schema"),
        ({"response_format": {"type": "json_object"}, "tools": [WEATHER]}, "with tools"),
        ({"tool_choice": "required"}, "has no tools"),
        ({"top_logprobs": 3}, "needs logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "0 to 20"),
    ]
    for fields, said in cases:
        with pytest.raises(ApiError, match=said.replace("[", r"\[")) as err:
            _chat(**fields)
        assert err.value.status == 400


def test_logprobs_are_asked_for_and_written_in_openais_shapes() -> None:
    assert _chat(logprobs=True, top_logprobs=3).logprobs == 3
    assert _chat(logprobs=True).logprobs == 0 and _chat().logprobs is None
    body = json.dumps({"prompt": "x", "logprobs": 2}).encode()
    assert completions.parse(body, {"m"}, api.Defaults(), api.Limits()).logprobs == 2
    entries = [["He", -0.5, [["He", -0.5], ["A", -1.0]]], ["llo", -0.1, [["llo", -0.1]]]]
    chat = structured.chat_content(entries)["content"]
    assert chat[0]["token"] == "He" and chat[0]["bytes"] == [72, 101]
    assert [t["token"] for t in chat[0]["top_logprobs"]] == ["He", "A"]
    legacy = structured.completion_content(entries)
    assert legacy["text_offset"] == [0, 2] and legacy["top_logprobs"][0] == {"He": -0.5, "A": -1.0}


def test_a_template_without_tools_gets_the_generic_format() -> None:
    call = _chat(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    shape = api.ChatShape("m", call, ModelTools(template=False))
    system, user = shape.turn_messages()
    assert system["role"] == "system" and '"get_weather"' in system["content"]
    assert '"response"' not in system["content"]  # forced: no answer without a call
    assert user == ASK[0]
    assert call.grammar == grammar.generic_tools([WEATHER], forced=True, parallel=False)
    reply = {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}]}
    text, calls = shape.read_whole(json.dumps(reply))
    assert text == "" and json.loads(calls[0]["function"]["arguments"])["city"] == "Oslo"
    # auto: the model may answer instead; its answer is the reply's text.
    auto = _chat(tools=[WEATHER])
    shape = api.ChatShape("m", auto, None)
    assert '"response"' in shape.turn_messages()[0]["content"]
    assert shape.read_whole('{"response": "It is sunny"}') == ("It is sunny", [])
    assert shape.read_whole('{"tool_calls": [') == ('{"tool_calls": [', [])  # cut short
    # Parameters the grammar cannot enforce: a 400 naming the keyword, not a 500.
    odd = {"type": "function", "function": {"name": "f", "parameters": {"not": {}}}}
    with pytest.raises(ApiError, match=r'Unimplemented keys: \["not"\]') as err:
        api.ChatShape("m", _chat(tools=[odd]), None)
    assert err.value.status == 400 and err.value.param == "tools"


def test_earlier_calls_and_results_are_written_for_any_template() -> None:
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]
    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "", "tool_calls": json.dumps(calls)},
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
    ]
    out = generic_tools.messages(conversation, [WEATHER], forced=False)
    assert out[0]["content"].startswith("Be brief.\n\nYou can call these tools")
    assert json.loads(out[2]["content"]) == {"tool_calls": [{"name": "f", "arguments": {"a": 1}}]}
    assert "tool_calls" not in out[2]
    assert out[3] == {"role": "user", "content": "The result of tool call c1: 42"}


def test_anthropics_messages_take_the_generic_format_too() -> None:
    weather = {
        "name": "get_weather",
        "description": "The weather in a city",
        "input_schema": WEATHER["function"]["parameters"],
    }
    body = {"max_tokens": 50, "messages": ASK, "tools": [weather], "tool_choice": {"type": "any"}}
    call = anthropic.parse(json.dumps(body).encode(), {"m"}, api.Defaults(), api.Limits())
    shape = anthropic.Shape("m", call, ModelTools(template=False))
    assert '"get_weather"' in shape.turn_messages()[0]["content"] and call.grammar is not None
    reply = {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}]}
    job = SimpleNamespace(
        reply=json.dumps(reply),
        stop_text=SimpleNamespace(hit=False),
        request=SimpleNamespace(use_cache=True),
    )
    result = TurnResult("s", job.reply, 10, 0, 10, 20, 0.0, 0.0, 0.0, 1, finish_reason="stop")
    doc = shape.whole(job, result)
    assert doc["stop_reason"] == "tool_use"
    assert [(b["type"], b.get("input")) for b in doc["content"]] == [
        ("tool_use", {"city": "Oslo", "unit": "c"})
    ]
