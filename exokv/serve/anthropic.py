"""POST /v1/messages: Anthropic's Messages API over the same turn path as OpenAI's chat.

`system` (a string or text blocks), `messages` of text content blocks, `max_tokens`
(required, as Anthropic requires it), `stop_sequences`, `temperature`, `top_p`,
`stream` with Anthropic's event types, and `tools` in Anthropic's shape (tool_use and
tool_result blocks; exokv.serve.tools renders and parses them as for OpenAI's).
`usage.cache_read_input_tokens` is what the prefix cache served,
`cache_creation_input_tokens` what the turn prefilled and stored in it, and
`input_tokens` the rest, as Anthropic counts them; errors come in Anthropic's shape,
{"type": "error", "error": {"type", "message"}}.
"""

from __future__ import annotations

import json
from typing import Any

from exokv.serve import api
from exokv.serve.tools import ModelTools

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "invalid_request_error",  # the body did not all come in time
    413: "request_too_large",
    499: "invalid_request_error",
    500: "api_error",
    503: "overloaded_error",
}


def error_doc(err: api.ApiError) -> dict[str, Any]:
    kind = ERROR_TYPES.get(err.status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": err.message}}


def _text(value: Any, where: str, limits: api.Limits) -> str:
    """A string, or a list of text blocks joined."""
    if isinstance(value, list):
        texts = []
        for block in value:
            if not isinstance(block, dict) or block.get("type") != "text":
                kind = block.get("type") if isinstance(block, dict) else type(block).__name__
                raise api.bad(f"{where}: {kind!r} blocks are not supported (text only)", where)
            if not isinstance(block.get("text"), str):
                raise api.bad(f"{where}: a text block needs a string 'text'", where)
            texts.append(block["text"])
        value = "".join(texts)
    if not isinstance(value, str):
        raise api.bad(f"{where} must be a string or a list of text blocks", where)
    if len(value) > limits.message_chars:
        raise api.bad(f"{where} is {len(value):,} characters; at most {limits.message_chars:,}")
    return value


def parse(
    body: bytes,
    models: set[str],
    defaults: api.Defaults,
    limits: api.Limits,
    counting: bool = False,
) -> api.ChatCall:
    """A checked /v1/messages request; `counting`: one for /v1/messages/count_tokens,
    which renders the same prompt and has no max_tokens to require."""
    doc = api.read_doc(body, models)
    if not counting and api.whole(doc, "max_tokens") is None:
        raise api.bad("max_tokens: Field required", "max_tokens")
    tools, forced, forced_name = _tools(doc)
    raw = api.message_list(doc, limits)
    messages: list[dict[str, str]] = []
    if doc.get("system") is not None:
        messages.append({"role": "system", "content": _text(doc["system"], "system", limits)})
    elif defaults.system:  # the model's SYSTEM (an ollama model's), as for chat requests
        messages.append({"role": "system", "content": defaults.system})
    for i, message in enumerate(raw):
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            raise api.bad(f"messages[{i}].role: use user or assistant", "messages")
        messages += _turned(message, i, limits)
    if messages[-1]["role"] not in ("user", "tool"):
        raise api.bad("the last message must be the user's", "messages")
    fields = api.sampling(doc, defaults, limits, ("max_tokens",))
    fields["include_usage"] = True
    return api.ChatCall(
        messages=messages,
        stop=api.stops(doc, limits, "stop_sequences"),
        tools=tools,
        tool_messages=api.calls_tools(messages),
        forced=forced,
        forced_name=forced_name,
        **fields,
    )


def _tools(doc: dict[str, Any]) -> tuple[list[dict[str, Any]], bool, str | None]:
    """Anthropic's tools in the shape chat templates read (OpenAI's), whether the
    reply must call one (tool_choice any or tool), and which (tool: its name)."""
    tools = doc.get("tools")
    if not tools:
        kind = doc["tool_choice"].get("type") if isinstance(doc.get("tool_choice"), dict) else None
        if kind in ("any", "tool"):
            raise api.bad(
                "tool_choice asks for a tool call, and the request has no tools", "tool_choice"
            )
        return [], False, None
    if not isinstance(tools, list) or not all(
        isinstance(t, dict) and isinstance(t.get("name"), str) for t in tools
    ):
        raise api.bad("tools: a list of {name, description, input_schema}", "tools")
    choice = doc.get("tool_choice") or {"type": "auto"}
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind == "none":
        return [], False, None
    if kind not in ("auto", "any", "tool"):
        raise api.bad(
            'tool_choice: {"type": "auto"}, "none", "any", or "tool" with its "name"',
            "tool_choice",
        )
    shaped = [
        {
            "type": "function",
            "function": {
                "name": t["name"],
                "description": t.get("description", ""),
                "parameters": t.get("input_schema", {"type": "object"}),
            },
        }
        for t in tools
    ]
    if kind == "tool":
        return api.named_tool(shaped, choice.get("name")), True, choice.get("name")
    return shaped, kind == "any", None


def _turned(message: dict[str, Any], i: int, limits: api.Limits) -> list[dict[str, str]]:
    """One Anthropic message as chat messages: its text, an assistant's tool_use blocks
    as tool_calls, a user's tool_result blocks as role "tool" messages before its text."""
    where = f"messages[{i}].content"
    blocks = message.get("content")
    if not isinstance(blocks, list):
        return [{"role": message["role"], "content": _text(blocks, where, limits)}]
    texts, calls, results = [], [], []
    for block in blocks:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "tool_use" and message["role"] == "assistant":
            function = {"name": str(block.get("name")), "arguments": block.get("input", {})}
            calls.append({"id": str(block.get("id", "")), "type": "function", "function": function})
        elif kind == "tool_result" and message["role"] == "user":
            content = block.get("content")
            content = _text(content if content is not None else "", where, limits)
            tool_id = str(block.get("tool_use_id", ""))
            results.append({"role": "tool", "tool_call_id": tool_id, "content": content})
        elif kind in ("thinking", "redacted_thinking"):
            continue  # an agent's record of its reasoning: not shown to this model again
        else:
            texts.append(block)
    text = _text(texts, where, limits) if texts else ""
    if message["role"] == "assistant":
        out = {"role": "assistant", "content": text}
        if calls:
            out["tool_calls"] = json.dumps(calls, sort_keys=True, ensure_ascii=False)
        return [out]
    return results + ([{"role": "user", "content": text}] if texts or not results else [])


def usage(result: Any, stored: bool) -> dict[str, Any]:
    """Anthropic's usage of a turn: the prompt cut in three that sum to it. What the
    prefix cache served is read; what this turn prefilled is created when the turn's
    cache is on (the engine stores the whole prompt after every turn it runs with the
    cache); input_tokens is the rest (all of the prefill with --no-cache)."""
    created = result.prefilled_tokens if stored else 0
    return {
        "input_tokens": result.prompt_tokens - result.cached_tokens - created,
        "output_tokens": result.generated_tokens,
        "cache_read_input_tokens": result.cached_tokens,
        "cache_creation_input_tokens": created,
    }


def _event(kind: str, doc: dict[str, Any]) -> bytes:
    data = json.dumps({"type": kind, **doc}, ensure_ascii=False)
    return f"event: {kind}\ndata: {data}\n\n".encode()


class Shape(api.ToolsShape):
    """The reply: a message, or Anthropic's stream of events."""

    PREFIX = "msg_"
    # message_start's usage says the prompt's tokens: the app counts them (exokv.serve.
    # prompts) into `prompt_tokens` before the opening, as the ranks render the prompt.
    opening_counts_prompt = True

    def __init__(self, model: str, call: api.ChatCall, tools: ModelTools | None = None) -> None:
        super().__init__(model, call, tools)
        self.prompt_tokens: int | None = None
        # A forced call's reply starts inside the call: no text block before it.
        self._text_open = not self._prefix  # the text block `_text_index` takes text
        self._blocks = int(self._text_open)  # content blocks opened (a first text block is 0)
        self._text_index = 0

    def error_doc(self, err: api.ApiError) -> dict[str, Any]:
        return error_doc(err)

    def _stop(self, job: Any, result: Any, calls: bool = False) -> dict[str, Any]:
        if calls:
            return {"stop_reason": "tool_use", "stop_sequence": None}
        if job.stop_text.hit:
            return {"stop_reason": "stop_sequence", "stop_sequence": job.stop_text.which}
        reason = "end_turn" if result.finish_reason == "stop" else "max_tokens"
        return {"stop_reason": reason, "stop_sequence": None}

    @staticmethod
    def _usage(job: Any, result: Any) -> dict[str, Any]:
        return usage(result, job.request.use_cache)

    def _message(self, content: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.ident,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
        }

    def whole(self, job: Any, result: Any) -> dict[str, Any]:
        text, calls = self.read_whole(job.reply)
        content = [{"type": "text", "text": text}] if text or not calls else []
        content += [_tool_use(c) for c in calls]
        stop = self._stop(job, result, bool(calls))
        return {**self._message(content), **stop, "usage": self._usage(job, result)}

    def _said(self, text: str, calls: list[dict[str, Any]]) -> list[bytes]:
        out = []
        if text and not self._text_open:  # text after a call: a new text block
            self._text_index, self._blocks = self._blocks, self._blocks + 1
            block = {"index": self._text_index, "content_block": {"type": "text", "text": ""}}
            out.append(_event("content_block_start", block))
            self._text_open = True
        if text:
            out += self.piece_of_text(text)
        for call in calls:  # each call whole: its block, its input, its end
            out += self._close_text()
            index, self._blocks = self._blocks, self._blocks + 1
            block = {**_tool_use(call), "input": {}}
            delta = {"type": "input_json_delta", "partial_json": call["function"]["arguments"]}
            out += [
                _event("content_block_start", {"index": index, "content_block": block}),
                _event("content_block_delta", {"index": index, "delta": delta}),
                _event("content_block_stop", {"index": index}),
            ]
        return out

    def _close_text(self) -> list[bytes]:
        """The open text block's end, if one is open (a call, or the message, ends it)."""
        if not self._text_open:
            return []
        self._text_open = False
        return [_event("content_block_stop", {"index": self._text_index})]

    def opening(self) -> list[bytes]:
        # The prompt's tokens; how the cache splits them is known when the turn ends
        # (message_delta's usage).
        usage = {"input_tokens": self.prompt_tokens or 0, "output_tokens": 0}
        message = {**self._message([]), "stop_reason": None, "stop_sequence": None}
        out = [_event("message_start", {"message": {**message, "usage": usage}})]
        if self._text_open:
            block = {"index": 0, "content_block": {"type": "text", "text": ""}}
            out.append(_event("content_block_start", block))
        return out

    def piece_of_text(self, text: str) -> list[bytes]:
        delta = {"type": "text_delta", "text": text}
        return [_event("content_block_delta", {"index": self._text_index, "delta": delta})]

    def piece(self, text: str) -> list[bytes]:
        if self._text is None:
            return self.piece_of_text(text)
        return self._said(*self._text.feed(text))

    def closing(self, job: Any, result: Any) -> list[bytes]:
        out = self._said(*self._text.flush()) if self._text is not None else []
        out += self._close_text()
        stop = self._stop(job, result, self._text is not None and bool(self._text.calls))
        out.append(_event("message_delta", {"delta": stop, "usage": self._usage(job, result)}))
        return out + [_event("message_stop", {})]

    def broken(self, err: api.ApiError, job: Any) -> list[bytes]:
        used = self._usage(job, job.result) if job.result is not None else {"output_tokens": 0}
        stop = {"stop_reason": "max_tokens", "stop_sequence": None}
        out = [_event("error", {"error": error_doc(err)["error"]}), *self._close_text()]
        out.append(_event("message_delta", {"delta": stop, "usage": used}))
        return out + [_event("message_stop", {})]


def _tool_use(call: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI-shaped parsed call as Anthropic's tool_use block."""
    try:
        arguments = json.loads(call["function"]["arguments"])
    except ValueError:
        arguments = {}
    return {
        "type": "tool_use",
        "id": "toolu_" + call["id"].removeprefix("call_"),
        "name": call["function"]["name"],
        "input": arguments if isinstance(arguments, dict) else {"value": arguments},
    }
