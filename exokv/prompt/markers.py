"""What the chat template sees, for requests that are not a plain chat.

A turn travels to every rank as its messages (exokv.core.records.TurnRequest) and every
rank renders them alike (exokv.prompt.render). Three kinds of request need more than the
template's `messages`: a raw prompt (POST /v1/completions: no template at all), a
chat with tools (the template's own `tools` argument), and a reply that must start
with given text (a forced tool call: the opening of the call, which the reply
continues). They are said in the messages
themselves, with marker roles no client can send (the server checks roles), so every
path that renders a turn (one at a time, batched, joined) renders them the same, and
`Marked` is the tokenizer every renderer asks.
"""

from __future__ import annotations

import json
from typing import Any

RAW = "exokv.raw"  # [{"role": RAW, "content": prompt}]: the prompt's text as is
TOOLS = "exokv.tools"  # a first message {"role": TOOLS, "content": JSON of the tools}
PREFIX = "exokv.prefix"  # a last message {"role": PREFIX, "content": the reply's start}


def raw_prompt(prompt: str) -> list[dict[str, str]]:
    return [{"role": RAW, "content": prompt}]


def tools_message(tools: list[dict[str, Any]]) -> dict[str, str]:
    return {"role": TOOLS, "content": json.dumps(tools, sort_keys=True)}


def reply_prefix(text: str) -> dict[str, str]:
    return {"role": PREFIX, "content": text}


class Marked:
    """A tokenizer whose chat template reads the marker messages (the module docstring)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tokenizer, name)

    def encode(self, text: str, **kw: Any) -> Any:
        return self.tokenizer.encode(text, **kw)

    def apply_chat_template(self, messages: list[dict[str, Any]], **kw: Any) -> Any:
        if len(messages) == 1 and messages[0].get("role") == RAW:
            return messages[0]["content"]
        tools = None
        if messages and messages[0].get("role") == TOOLS:
            tools = json.loads(messages[0]["content"])
            messages = messages[1:]
        prefix = ""
        if messages and messages[-1].get("role") == PREFIX:
            # After the generation prompt: the renderers ask for text (tokenize=False).
            prefix, messages = messages[-1]["content"], messages[:-1]
        messages = [_unpacked(m) for m in messages]
        if tools is not None:
            kw["tools"] = tools
        out = self.tokenizer.apply_chat_template(messages, **kw)
        return out + prefix if prefix else out


def _unpacked(message: dict[str, Any]) -> dict[str, Any]:
    """A message's tool calls travel as JSON text (hashable, so renders are remembered);
    the template gets them as OpenAI's list, each call's arguments an object."""
    calls = message.get("tool_calls")
    if not isinstance(calls, str):
        return message
    return {**message, "tool_calls": json.loads(calls)}


def has_tools_support(template: str | None) -> bool:
    """Whether a chat template reads the `tools` argument (its own tool calling)."""
    return bool(template) and "tools" in template
