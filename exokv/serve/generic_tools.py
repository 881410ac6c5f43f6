"""Tools on a model whose chat template does not read them: a generic format.

As llama.cpp serves tools on any model: the tools are described in the system
prompt, and the reply is one JSON object the grammar enforces
(exokv.prompt.grammar.generic_tools): `{"tool_calls": [{"name", "arguments"}, ...]}`,
or, when the model may decide (tool_choice auto), either that or
`{"response": TEXT}`. The reply is read whole once it has ended (its JSON says which
it is only then), so a streamed generic-format reply comes in one piece at the end.
Earlier calls and their results in the conversation are written as the same JSON and
as user messages, so any template renders them.
"""

from __future__ import annotations

import json
from typing import Any

from exokv.serve.tools import ModelTools, openai_call


def needed(tools: ModelTools | None, forced: bool, forced_name: str | None) -> bool:
    """Whether a request with tools takes the generic format: the template does not
    read `tools`, or the call is forced and the template shows no way to force it."""
    if tools is None or not tools.template:
        return True
    return forced and tools.opening(forced_name) is None


def instructions(tools: list[dict[str, Any]], forced: bool) -> str:
    """The system prompt's text that offers the tools."""
    listed = json.dumps([t["function"] for t in tools], ensure_ascii=False, indent=1)
    text = (
        f"You can call these tools:\n{listed}\n\nTo call tools, reply with only a JSON "
        'object: {"tool_calls": [{"name": "<a tool\'s name>", "arguments": {<its '
        "parameters>}}]}."
    )
    if not forced:
        text += ' To answer without a tool, reply with only {"response": "<your answer>"}.'
    return text


def messages(
    conversation: list[dict[str, Any]], tools: list[dict[str, Any]], forced: bool
) -> list[dict[str, Any]]:
    """The conversation as the model reads it in the generic format: the tools in the
    (first) system message, calls as their JSON, tool results as user messages."""
    out = [_plain(m) for m in conversation]
    if not tools:
        return out
    offer = instructions(tools, forced)
    if out and out[0]["role"] == "system":
        out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{offer}"}
    else:
        out.insert(0, {"role": "system", "content": offer})
    return out


def _plain(message: dict[str, Any]) -> dict[str, Any]:
    if message["role"] == "tool":
        ident = message.get("tool_call_id") or ""
        said = f"The result of tool call {ident}: " if ident else "A tool's result: "
        return {"role": "user", "content": said + message["content"]}
    if "tool_calls" in message:
        calls = [
            {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
            for c in json.loads(message["tool_calls"])
        ]
        text = json.dumps({"tool_calls": calls}, ensure_ascii=False)
        return {"role": "assistant", "content": message["content"] + text}
    return message


class GenericText:
    """A generic-format reply read as ToolText reads a template's: nothing until it
    ends, then its text ({"response"}) or its calls ({"tool_calls"}). A reply that is
    neither (cut short by max_tokens) is its text as written."""

    def __init__(self) -> None:
        self.pending = ""
        self.calls: list[dict[str, Any]] = []

    def feed(self, piece: str) -> tuple[str, list[dict[str, Any]]]:
        self.pending += piece
        return "", []

    def flush(self) -> tuple[str, list[dict[str, Any]]]:
        text, self.pending = self.pending, ""
        try:
            doc = json.loads(text)
        except ValueError:
            return text, []
        if isinstance(doc, dict) and isinstance(doc.get("response"), str):
            return doc["response"], []
        calls = doc.get("tool_calls") if isinstance(doc, dict) else None
        if not isinstance(calls, list) or not all(
            isinstance(c, dict) and isinstance(c.get("name"), str) for c in calls
        ):
            return text, []
        self.calls = [openai_call(c) for c in calls]
        return "", self.calls
