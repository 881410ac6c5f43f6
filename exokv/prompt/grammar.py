"""What a constrained reply may be: a JSON schema, any JSON object, or a tool call, as
the grammar text the ranks' sampler enforces (exokv.rank.constrain).

The grammar is llguidance's (its JSON-schema compiler, chosen by
benchmarks/grammar_libs.py): a front end turns a request's `response_format`, Ollama's
`format` or a generic tool call into one string here, checked before any rank sees it;
the string travels in the turn's request and every rank builds the same matcher from
it. Pure: no tokenizer, no MLX.
"""

from __future__ import annotations

import json
from typing import Any

import llguidance

# Compact JSON (", " and ": " between items): a model, even one with random weights,
# cannot pad a reply with whitespace for ever.
_COMPACT = {"whitespace_flexible": False}


class GrammarError(ValueError):
    """A schema this server cannot enforce; the message names the keyword or the fault."""


def from_schema(schema: Any) -> str:
    """The grammar of the JSON documents `schema` (a JSON schema object) allows;
    GrammarError naming the keyword llguidance cannot enforce (`not`, `if`, ...)."""
    if isinstance(schema, bool) or not isinstance(schema, dict):
        raise GrammarError("a JSON schema must be an object")
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            json.dumps(schema), defaults=_COMPACT
        )
    except (ValueError, TypeError) as err:
        raise GrammarError(str(err)) from None
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if failed:
        raise GrammarError(messages[0] if messages else "the schema cannot be enforced")
    return grammar


def any_object() -> str:
    """The grammar of any JSON object (OpenAI's `json_object`, Ollama's "json")."""
    return from_schema({"type": "object"})


def from_format(value: Any) -> str:
    """The constraint for a format given as Ollama's `format` is: "json" (any JSON
    object) or a JSON schema. GrammarError for anything else, or a schema it cannot
    enforce. This is the hook other APIs pass their format through."""
    if value == "json":
        return any_object()
    if isinstance(value, dict):
        return from_schema(value)
    raise GrammarError('a format is "json" or a JSON schema object')


# -- a tool call in the generic format (a model whose template has no tools) --------


def call_schema(tools: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """The JSON a generic-format call is: {"tool_calls": [{"name", "arguments"}, ...]},
    each call's name one of `tools`' and its arguments their `parameters`."""
    choices = []
    for tool in tools:
        function = tool["function"]
        parameters = function.get("parameters") or {"type": "object"}
        choices.append(
            {
                "type": "object",
                "properties": {"name": {"const": function["name"]}, "arguments": parameters},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    calls: dict[str, Any] = {"type": "array", "items": {"anyOf": choices}, "minItems": 1}
    if not parallel:
        calls["maxItems"] = 1
    return {
        "type": "object",
        "properties": {"tool_calls": calls},
        "required": ["tool_calls"],
        "additionalProperties": False,
    }


RESPONSE_SCHEMA = {
    "type": "object",
    "properties": {"response": {"type": "string"}},
    "required": ["response"],
    "additionalProperties": False,
}


def generic_tools(tools: list[dict[str, Any]], forced: bool, parallel: bool) -> str:
    """The grammar of a generic-format reply: a call (forced: only that), or, when the
    model may decide, either a call or {"response": TEXT}."""
    schema = call_schema(tools, parallel)
    if not forced:
        schema = {"anyOf": [schema, RESPONSE_SCHEMA]}
    return from_schema(schema)


def forced_call(calls: list[tuple[str, dict[str, Any]]], tail: str) -> str:
    """The grammar of the rest of a call a template writes, after its opening: one of
    `calls` (each the text before its arguments and its function), the arguments as
    JSON valid for the function's `parameters`, then `tail` (up to the end marker)."""
    rules, names = [], []
    for i, (before, function) in enumerate(calls):
        parameters = json.dumps(function.get("parameters") or {"type": "object"})
        head = f"{_literal(before)} " if before else ""
        rules.append(f"call{i}: {head}%json {parameters}")
        names.append(f"call{i}")
    lark = "\n".join([f"start: ({' | '.join(names)}) {_literal(tail)}", *rules])
    try:
        text = llguidance.LLMatcher.grammar_from_lark(lark)
    except (ValueError, TypeError) as err:
        raise GrammarError(str(err)) from None
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(text)
    if failed:
        raise GrammarError(messages[0] if messages else "the call cannot be enforced")
    return text


def _literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)  # a Lark string: JSON's escapes
