"""POST /v1/responses: OpenAI's Responses API over the same turn path as chat.

`input` (a string, or items: messages of input_text/output_text parts, function_call
and function_call_output items), `instructions` (the system message),
`max_output_tokens`, `temperature`, `top_p`, function `tools` and `tool_choice`
(rendered and read by exokv.serve.tools, as for chat), and `stream` with the
Responses event types, each with its `sequence_number`. A reply cut by
max_output_tokens is `status: "incomplete"` (its stream ends with
`response.incomplete`), as OpenAI's is.

`previous_response_id`: each stored response (`store`, true by default) keeps its
conversation, in chat messages, in a bounded store in memory (`ResponseStore`), so a
client that sends only the new turn gets the same prompt as one that resends the
whole conversation: the same `api-` session, the same reply tokens from the state
database (exokv.serve.replies), the same prefix-cache hit. `GET /v1/responses/{id}`
returns a stored response. Errors come in OpenAI's shape.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from exokv.serve import api, structured
from exokv.serve.errors import ApiError
from exokv.serve.tools import ModelTools

STORE_RESPONSES = 1024  # responses kept for previous_response_id, the oldest dropped
STORE_CHARS = 64 << 20  # and the characters their conversations may hold in all
# Request fields that would change the reply and that this server cannot apply:
# refused, never ignored (the value each may keep to mean "off").
UNSUPPORTED = {
    "background": False,
    "conversation": None,
    "prompt": None,
    "top_logprobs": 0,
    "max_tool_calls": None,
}


@dataclass
class ResponsesCall(api.ChatCall):
    """One checked POST /v1/responses: the chat call its turn runs, and what its
    reply echoes and stores."""

    history: list[dict[str, Any]] = field(default_factory=list)  # messages, no system
    instructions: str | None = None
    previous: str | None = None  # previous_response_id
    store: bool = True
    metadata: dict[str, Any] = field(default_factory=dict)
    parallel: bool = True  # parallel_tool_calls, echoed
    tool_choice: Any = "auto"  # as the request said it, echoed
    shown_tools: list[dict[str, Any]] = field(default_factory=list)  # the request's, echoed


class ResponseStore:
    """Stored responses, newest last: each one's conversation (chat messages without
    the system message, its reply last) and its document (GET /v1/responses/{id}).
    Bounded in count and characters; the least recently used go first."""

    def __init__(self, items: int = STORE_RESPONSES, chars: int = STORE_CHARS) -> None:
        self.items = items
        self.chars = chars
        self._held: OrderedDict[str, tuple[list[dict[str, Any]], dict[str, Any], int]] = (
            OrderedDict()
        )
        self._size = 0

    def __len__(self) -> int:
        return len(self._held)

    def put(self, ident: str, messages: list[dict[str, Any]], doc: dict[str, Any]) -> None:
        size = sum(len(str(m.get("content", ""))) + len(m.get("tool_calls", "")) for m in messages)
        self._held[ident] = (messages, doc, size)
        self._size += size
        while len(self._held) > self.items or (self._size > self.chars and len(self._held) > 1):
            _, (_, _, dropped) = self._held.popitem(last=False)
            self._size -= dropped

    def _get(self, ident: Any, param: str) -> tuple[list[dict[str, Any]], dict[str, Any], int]:
        held = self._held.get(ident) if isinstance(ident, str) else None
        if held is None:
            raise api.ApiError(
                404,
                f"Previous response with id {ident!r} not found: this server keeps the last "
                f"{self.items:,} stored responses, in memory, until it stops",
                param=param,
                code="previous_response_not_found",
            )
        self._held.move_to_end(ident)
        return held

    def messages(self, ident: Any) -> list[dict[str, Any]]:
        """The conversation of stored response `ident`, its reply last; 404 if unknown."""
        return list(self._get(ident, "previous_response_id")[0])

    def doc(self, ident: str) -> dict[str, Any]:
        """Stored response `ident` as it was returned; 404 if unknown."""
        return self._get(ident, "response_id")[1]


def _refuse_unsupported(doc: dict[str, Any]) -> None:
    for name, off in UNSUPPORTED.items():
        if doc.get(name) not in (None, off):
            raise api.bad(f"{name} is not supported by this server", name)
    reasoning = doc.get("reasoning")
    if reasoning is not None and (
        not isinstance(reasoning, dict) or any(reasoning.get(k) for k in ("effort", "summary"))
    ):
        raise api.bad("reasoning: this server's models take no reasoning effort", "reasoning")
    text = doc.get("text") or {}
    if not isinstance(text, dict):
        raise api.bad("text must be an object (text.format, text.verbosity)", "text")
    if text.get("verbosity") not in (None, "medium"):
        raise api.bad("text.verbosity: only 'medium' is supported", "text.verbosity")
    if doc.get("truncation") not in (None, "disabled"):
        raise api.bad("truncation: only 'disabled' (a prompt too long is a 400)", "truncation")


def _text_format(doc: dict[str, Any]) -> str | None:
    """The grammar `text.format` holds the reply to, as chat's response_format does
    (the Responses API puts json_schema's name, schema and strict beside its type)."""
    shape = (doc.get("text") or {}).get("format")
    if shape is None:
        return None
    if not isinstance(shape, dict):
        raise api.bad("text.format must be an object", "text.format")
    kind = shape.get("type", "text")
    if kind == "json_schema":
        if not isinstance(shape.get("schema"), dict):
            raise api.bad("text.format json_schema needs its schema (an object)", "text.format")
        spec = {k: shape[k] for k in ("name", "schema", "strict") if k in shape}
        shape = {"type": "json_schema", "json_schema": spec}
    elif kind not in ("text", "json_object"):
        raise api.bad("text.format: text, json_object or json_schema", "text.format")
    if kind != "text" and doc.get("tools"):
        raise api.bad("text.format and tools cannot be asked together", "text.format")
    try:
        return structured.response_format({"response_format": shape})
    except ApiError as err:
        raise api.bad(
            err.message.replace("response_format", "text.format"), "text.format"
        ) from None


def _tools(doc: dict[str, Any]) -> tuple[list[dict[str, Any]], bool, str | None]:
    """The request's function tools in the shape chat templates read, whether the
    reply must call one, and which (a named tool_choice)."""
    tools = doc.get("tools")
    if not tools:
        return [], False, None
    if not isinstance(tools, list):
        raise api.bad("tools must be a list", "tools")
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise api.bad(f"tools[{i}]: {kind!r} tools are not supported (function only)", "tools")
        if not isinstance(tool.get("name"), str):
            raise api.bad(f"tools[{i}]: a function tool needs a string 'name'", "tools")
    shaped = [
        {
            "type": "function",
            "function": {
                "name": t["name"],
                "description": t.get("description") or "",
                "parameters": t.get("parameters") or {"type": "object", "properties": {}},
            },
        }
        for t in tools
    ]
    choice = doc.get("tool_choice", "auto")
    if choice == "none":
        return [], False, None
    if choice in ("auto", "required"):
        return shaped, choice == "required", None
    if isinstance(choice, dict) and choice.get("type") == "function":
        return api.named_tool(shaped, choice.get("name")), True, choice.get("name")
    raise api.bad(
        'tool_choice: "auto", "none", "required" or {"type": "function", "name": ...}',
        "tool_choice",
    )


def _text(value: Any, where: str, limits: api.Limits) -> str:
    """A string, or a list of text parts (input_text, output_text) joined."""
    if isinstance(value, list):
        texts = []
        for part in value:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind not in ("input_text", "output_text", "text", "refusal"):
                raise api.bad(f"{where}: {kind!r} parts are not supported (text only)", "input")
            text = part.get("text", part.get("refusal"))
            if not isinstance(text, str):
                raise api.bad(f"{where}: a {kind} part needs a string 'text'", "input")
            texts.append(text)
        value = "".join(texts)
    if not isinstance(value, str):
        raise api.bad(f"{where} must be a string or a list of text parts", "input")
    if len(value) > limits.message_chars:
        raise api.bad(f"{where} is {len(value):,} characters; at most {limits.message_chars:,}")
    return value


def _arguments(item: dict[str, Any], where: str) -> Any:
    arguments = item.get("arguments") or "{}"
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            raise api.bad(f"{where}.arguments must be JSON", "input") from None
    return arguments


def _items(value: Any, limits: api.Limits) -> list[dict[str, Any]]:
    """The request's input as chat messages: messages as they are, function_call
    items as the tool calls of the assistant message before them (or of one of their
    own), function_call_output items as role "tool" messages."""
    if isinstance(value, str):
        value = [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise api.bad("input must be a non-empty string or list of items", "input")
    messages: list[dict[str, Any]] = []
    calls: dict[int, list[dict[str, Any]]] = {}  # an assistant message's index: its calls
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise api.bad(f"{where} must be an object", "input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise api.bad(f"{where}.role {role!r}: use user, assistant, system or developer")
            role = "system" if role == "developer" else role
            messages.append({"role": role, "content": _text(item.get("content"), where, limits)})
        elif kind == "function_call":
            if not isinstance(item.get("name"), str):
                raise api.bad(f"{where}: a function_call needs a string 'name'", "input")
            if not messages or messages[-1]["role"] != "assistant":
                messages.append({"role": "assistant", "content": ""})
            function = {"name": item["name"], "arguments": _arguments(item, where)}
            call = {"id": str(item.get("call_id") or ""), "type": "function", "function": function}
            calls.setdefault(len(messages) - 1, []).append(call)
        elif kind == "function_call_output":
            output = _text(item.get("output", ""), f"{where}.output", limits)
            tool_id = str(item.get("call_id") or "")
            messages.append({"role": "tool", "tool_call_id": tool_id, "content": output})
        elif kind == "reasoning":
            continue  # an agent's record of a model's reasoning: none is shown again
        else:
            raise api.bad(f"{where}: {kind!r} items are not supported", "input")
    for index, made in calls.items():
        messages[index]["tool_calls"] = json.dumps(made, sort_keys=True, ensure_ascii=False)
    return messages


def parse(
    body: bytes, models: set[str], defaults: api.Defaults, limits: api.Limits, store: ResponseStore
) -> ResponsesCall:
    """A checked /v1/responses request, its conversation continued from
    `previous_response_id`'s in `store`; ApiError (400, 404) otherwise."""
    doc = api.read_doc(body, models)
    _refuse_unsupported(doc)
    tools, forced, forced_name = _tools(doc)
    previous = doc.get("previous_response_id")
    history = store.messages(previous) if previous is not None else []
    history += _items(doc.get("input"), limits)
    instructions = doc.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise api.bad("instructions must be a string", "instructions")
    system = instructions if instructions is not None else defaults.system
    messages = ([{"role": "system", "content": system}] if system else []) + history
    if len(messages) > limits.messages:
        raise api.bad(f"{len(messages):,} messages; at most {limits.messages:,}", "input")
    if messages[-1]["role"] not in ("user", "tool"):
        raise api.bad("the last input item must be the user's (or a tool's output)", "input")
    store_it = doc.get("store", True)
    metadata = doc.get("metadata") or {}
    if not isinstance(store_it, bool) or not isinstance(metadata, dict):
        raise api.bad("store is true or false, metadata an object", "store")
    fields = api.sampling(doc, defaults, limits, ("max_output_tokens",))
    fields["include_usage"] = True
    fields["grammar"] = _text_format(doc)
    return ResponsesCall(
        messages=messages,
        tools=tools,
        tool_messages=api.calls_tools(messages),
        forced=forced,
        forced_name=forced_name,
        history=history,
        instructions=instructions,
        previous=previous,
        store=store_it,
        metadata=metadata,
        parallel=doc.get("parallel_tool_calls") is not False,
        tool_choice=doc.get("tool_choice", "auto"),
        shown_tools=[
            {"type": "function", "description": None, "parameters": None, "strict": None, **t}
            for t in doc.get("tools") or []
        ],
        **fields,
    )


# -- replies ----------------------------------------------------------------------


def usage(result: Any, stored: bool) -> dict[str, Any]:
    """The Responses API's usage of a turn: cached_tokens what the prefix cache served,
    cache_write_tokens what this turn prefilled and stored in it (none without the cache)."""
    prompt, generated = result.prompt_tokens, result.generated_tokens
    return {
        "input_tokens": prompt,
        "input_tokens_details": {
            "cached_tokens": result.cached_tokens,
            "cache_write_tokens": result.prefilled_tokens if stored else 0,
        },
        "output_tokens": generated,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + generated,
    }


def _output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _function_call(call: dict[str, Any], status: str = "completed") -> dict[str, Any]:
    """An OpenAI-shaped parsed call (exokv.serve.tools) as a function_call item."""
    return {
        "type": "function_call",
        "id": "fc_" + call["id"].removeprefix("call_"),
        "call_id": call["id"],
        "name": call["function"]["name"],
        "arguments": call["function"]["arguments"] if status == "completed" else "",
        "status": status,
    }


def _reply_message(text: str, calls: list[dict[str, Any]]) -> dict[str, Any]:
    """The reply as the chat message a later request's conversation holds (the
    template reads its calls' arguments as objects)."""
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        made = []
        for call in calls:
            try:
                arguments = json.loads(call["function"]["arguments"])
            except ValueError:
                arguments = {}
            function = {"name": call["function"]["name"], "arguments": arguments}
            made.append({"id": call["id"], "type": "function", "function": function})
        message["tool_calls"] = json.dumps(made, sort_keys=True, ensure_ascii=False)
    return message


class Shape(api.ToolsShape):
    """The reply: a response object, or the Responses API's stream of events."""

    PREFIX = "resp_"

    def __init__(
        self,
        model: str,
        call: ResponsesCall,
        tools: ModelTools | None = None,
        store: ResponseStore | None = None,
    ) -> None:
        super().__init__(model, call, tools)
        self.call: ResponsesCall = call
        self.store = store
        self.created = int(time.time())
        self._sequence = 0
        self._output: list[dict[str, Any]] = []  # the stream's items, done
        self._message: dict[str, Any] | None = None  # the message item taking text, if open
        self._said_text = ""

    # -- the response object --

    def _response(
        self, status: str, output: list[dict[str, Any]], used: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        call = self.call
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": self.ident,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": None,
            "incomplete_details": incomplete,
            "instructions": call.instructions,
            "max_output_tokens": call.max_tokens,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": call.parallel,
            "previous_response_id": call.previous,
            "reasoning": {"effort": None, "summary": None},
            "store": call.store,
            "temperature": call.temperature,
            "text": {"format": {"type": "text"}},
            "tool_choice": call.tool_choice,
            "tools": call.shown_tools,
            "top_p": call.top_p,
            "truncation": "disabled",
            "usage": used,
            "metadata": call.metadata,
        }

    @staticmethod
    def _status(job: Any, result: Any, calls: bool) -> str:
        if calls or api.finish_reason(result.finish_reason, job.stop_text.hit) == "stop":
            return "completed"
        return "incomplete"

    def _finished(self, job: Any, result: Any, text: str, calls: list[dict[str, Any]]) -> dict:
        """The final response object, stored (unless the request said not to)."""
        status = self._status(job, result, bool(calls))
        output = self._output or self._items(text, calls, status)
        doc = self._response(status, output, usage(result, job.request.use_cache))
        if self.store is not None and self.call.store:
            self.store.put(self.ident, [*self.call.history, _reply_message(text, calls)], doc)
        return doc

    def _items(self, text: str, calls: list[dict[str, Any]], status: str) -> list[dict]:
        items = []
        if text or not calls:
            items.append(self._message_item([_output_text(text)], status))
        return items + [_function_call(c) for c in calls]

    def _message_item(self, content: list[dict[str, Any]], status: str) -> dict[str, Any]:
        ident = f"msg_{self.ident.removeprefix('resp_')}_{len(self._output)}"
        return {
            "type": "message",
            "id": ident,
            "status": status,
            "role": "assistant",
            "content": content,
        }

    def whole(self, job: Any, result: Any) -> dict[str, Any]:
        return self._finished(job, result, *self.read_whole(job.reply))

    # -- the stream --

    def _event(self, kind: str, **doc: Any) -> bytes:
        data = json.dumps({"type": kind, **doc, "sequence_number": self._sequence})
        self._sequence += 1
        return f"event: {kind}\ndata: {data}\n\n".encode()

    def opening(self) -> list[bytes]:
        started = self._response("in_progress", [])
        return [
            self._event("response.created", response=started),
            self._event("response.in_progress", response=started),
        ]

    def _open_message(self) -> list[bytes]:
        self._message = self._message_item([], "in_progress")
        self._said_text = ""
        where = {"item_id": self._message["id"], "output_index": len(self._output)}
        return [
            self._event(
                "response.output_item.added", output_index=len(self._output), item=self._message
            ),
            self._event(
                "response.content_part.added", **where, content_index=0, part=_output_text("")
            ),
        ]

    def _close_message(self, status: str = "completed") -> list[bytes]:
        if self._message is None:
            return []
        text, item = self._said_text, self._message
        where = {"item_id": item["id"], "output_index": len(self._output), "content_index": 0}
        done = {**item, "status": status, "content": [_output_text(text)]}
        out = [
            self._event("response.output_text.done", **where, text=text, logprobs=[]),
            self._event("response.content_part.done", **where, part=_output_text(text)),
            self._event("response.output_item.done", output_index=len(self._output), item=done),
        ]
        self._output.append(done)
        self._message = None
        return out

    def _said(self, text: str, calls: list[dict[str, Any]]) -> list[bytes]:
        out = []
        if text:
            if self._message is None:
                out += self._open_message()
            assert self._message is not None
            self._said_text += text
            where = {"item_id": self._message["id"], "output_index": len(self._output)}
            out.append(
                self._event(
                    "response.output_text.delta", **where, content_index=0, delta=text, logprobs=[]
                )
            )
        for call in calls:  # each call whole: its item, its arguments, its end
            out += self._close_message()
            index, item = len(self._output), _function_call(call)
            arguments = item["arguments"]
            out += [
                self._event(
                    "response.output_item.added",
                    output_index=index,
                    item=_function_call(call, "in_progress"),
                ),
                self._event(
                    "response.function_call_arguments.delta",
                    item_id=item["id"],
                    output_index=index,
                    delta=arguments,
                ),
                self._event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    arguments=arguments,
                ),
                self._event("response.output_item.done", output_index=index, item=item),
            ]
            self._output.append(item)
        return out

    def piece(self, text: str) -> list[bytes]:
        if self._text is None:
            return self._said(text, [])
        return self._said(*self._text.feed(text))

    def closing(self, job: Any, result: Any) -> list[bytes]:
        out = self._said(*self._text.flush()) if self._text is not None else []
        calls = list(self._text.calls) if self._text is not None else []
        status = self._status(job, result, bool(calls))
        if not self._output and self._message is None:
            out += self._open_message()  # a reply of no text still has its message
        out += self._close_message(status)
        said = "".join(
            part["text"]
            for item in self._output
            if item["type"] == "message"
            for part in item["content"]
        )
        doc = self._finished(job, result, said, calls)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return out + [self._event(kind, response=doc)]

    def broken(self, err: api.ApiError, job: Any) -> list[bytes]:
        out = self._close_message("incomplete")
        failed = self._response("failed", self._output)
        failed["error"] = {"code": "server_error", "message": err.message}
        error = {"code": err.code, "message": err.message, "param": err.param}
        return out + [
            self._event("error", **error),
            self._event("response.failed", response=failed),
        ]
