"""OpenAI's chat-completions shapes: requests checked into a `ChatCall`, replies and
errors written as OpenAI's clients expect them. Pure: no I/O, no MLX."""

from __future__ import annotations

import hashlib
import json
import math
import re
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from exokv.prompt import grammar
from exokv.prompt.markers import reply_prefix, tools_message
from exokv.serve import generic_tools, structured
from exokv.serve.errors import ApiError
from exokv.serve.tools import ModelTools, ToolText, check, forced_opening

# developer: OpenAI's newer name for system, rendered as a system message; tool: a
# tool call's result (exokv.serve.tools).
ROLES = {"system", "user", "assistant", "developer", "tool"}
SEED_RANGE = 2**64  # mx.random.seed takes an unsigned 64-bit number
# Arrays and objects nested in a body at most (a tool's JSON schema is a few levels);
# json.loads itself fails with a RecursionError only near Python's recursion limit.
MAX_DEPTH = 64


@dataclass(frozen=True)
class Limits:
    """What one request may ask for; more is refused before it reaches the queue."""

    body_bytes: int = 1 << 20  # 413 above this
    messages: int = 1024
    message_chars: int = 1 << 20
    reply_tokens: int = 32768  # max_tokens above this is a 400
    stops: int = 4  # as OpenAI
    stop_chars: int = 256


@dataclass(frozen=True)
class Defaults:
    """What a request that leaves a setting out gets (the server's --max-tokens, --temp)."""

    max_tokens: int = 256
    temperature: float = 0.0
    system: str | None = None  # the model's own system prompt (an ollama model's SYSTEM)


@dataclass
class ChatCall:
    """One checked POST /v1/chat/completions."""

    messages: list[dict[str, str]]
    max_tokens: int
    temperature: float
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    tools: list[dict[str, Any]] = field(default_factory=list)  # rendered; [] with "none"
    tool_messages: bool = False  # role "tool" or assistant tool_calls in the messages
    # tool_choice required (OpenAI) or any (Anthropic): the reply is a call; a named
    # choice: a call of `forced_name`, the one tool left in `tools`.
    forced: bool = False
    forced_name: str | None = None
    parallel: bool = True  # parallel_tool_calls: several calls in one reply
    # The reply's grammar (exokv.prompt.grammar): response_format's, or the generic tool
    # format's (set by ToolsShape); None: free text.
    grammar: str | None = None
    logprobs: int | None = None  # top logprobs per token (0-20); None: no logprobs


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def _number(body: dict[str, Any], name: str, low: float, high: float, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad(f"{name} must be a number", name)
    if not low <= value <= high:
        raise bad(f"{name} must be between {low:g} and {high:g}, not {value!r}", name)
    return float(value)


def whole(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(f"{name} must be an integer", name)
    return value


def content(message: dict[str, Any], i: int, limits: Limits) -> str:
    content = message.get("content")
    if content is None and message.get("tool_calls"):
        content = ""  # an assistant message that only calls tools
    if isinstance(content, list):  # content parts: text only
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise bad(f"messages[{i}].content: only text parts are supported", "messages")
            if not isinstance(part.get("text"), str):
                raise bad(f"messages[{i}].content: a text part needs a string 'text'", "messages")
            texts.append(part["text"])
        content = "".join(texts)
    if not isinstance(content, str):
        raise bad(f"messages[{i}].content must be a string or a list of text parts", "messages")
    if len(content) > limits.message_chars:
        raise bad(
            f"messages[{i}].content is {len(content):,} characters; at most "
            f"{limits.message_chars:,}",
            "messages",
        )
    return content


def message_list(doc: dict[str, Any], limits: Limits) -> list[Any]:
    """The request's `messages`, a list of at most `limits.messages` (each not yet read)."""
    raw = doc.get("messages")
    if not isinstance(raw, list) or not raw:
        raise bad("messages must be a non-empty list", "messages")
    if len(raw) > limits.messages:
        raise bad(f"{len(raw):,} messages; at most {limits.messages:,}", "messages")
    return raw


def calls_tools(messages: list[dict[str, str]]) -> bool:
    """Whether the conversation has tool results or calls in it (its template must read them)."""
    return any(m["role"] == "tool" or "tool_calls" in m for m in messages)


def _messages(body: dict[str, Any], limits: Limits) -> list[dict[str, str]]:
    messages = []
    for i, message in enumerate(message_list(body, limits)):
        if not isinstance(message, dict):
            raise bad(f"messages[{i}] must be an object", "messages")
        role = message.get("role")
        if role not in ROLES:
            raise bad(
                f"messages[{i}].role {role!r}: use system, developer, user, assistant or tool",
                "messages",
            )
        role = "system" if role == "developer" else role
        entry = {"role": role, "content": content(message, i, limits)}
        if role == "tool":
            entry["tool_call_id"] = str(message.get("tool_call_id") or "")
        if role == "assistant" and message.get("tool_calls") is not None:
            entry["tool_calls"] = _tool_calls(message["tool_calls"], i)
        messages.append(entry)
    if messages[-1]["role"] not in ("user", "tool"):
        raise bad("the last message must be the user's (or a tool's result)", "messages")
    return messages


def _tool_calls(calls: Any, i: int) -> str:
    """An assistant message's tool calls as the template reads them (each call's
    arguments an object), kept as JSON text (exokv.prompt.markers unpacks it)."""
    where = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise bad(f"{where} must be a list", "messages")
    out = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise bad(f"{where}: each call needs function.name", "messages")
        arguments = function.get("arguments") or "{}"
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                raise bad(f"{where}: function.arguments must be JSON", "messages") from None
        out.append(
            {
                "id": str(call.get("id") or ""),
                "type": "function",
                "function": {"name": function["name"], "arguments": arguments},
            }
        )
    return json.dumps(out, sort_keys=True, ensure_ascii=False)


def named_tool(tools: list[dict[str, Any]], name: Any) -> list[dict[str, Any]]:
    """The one tool a named tool_choice leaves (the others are not offered); 400 if
    the request has no tool of that name."""
    chosen = [t for t in tools if t["function"]["name"] == name]
    if not isinstance(name, str) or not chosen:
        offered = ", ".join(t["function"]["name"] for t in tools)
        raise bad(
            f"tool_choice names {name!r}, which is not among the tools ({offered})", "tool_choice"
        )
    return chosen[:1]


def _tools(doc: dict[str, Any]) -> tuple[list[dict[str, Any]], bool, str | None]:
    """The request's tools, as the template gets them ([] for none or tool_choice
    none), whether the reply must call one, and which (a named choice)."""
    if doc.get("functions"):
        raise bad("functions is OpenAI's older form: send tools", "functions")
    tools = doc.get("tools")
    choice = doc.get("tool_choice", "auto")
    if tools is None or tools == []:
        if choice not in ("auto", "none", None):
            raise bad(
                "tool_choice asks for a tool call, and the request has no tools", "tool_choice"
            )
        return [], False, None
    if not isinstance(tools, list) or not all(
        isinstance(t, dict)
        and t.get("type") == "function"
        and isinstance(t.get("function"), dict)
        and isinstance(t["function"].get("name"), str)
        for t in tools
    ):
        raise bad("tools: a list of {type: function, function: {name, ...}}", "tools")
    if choice == "none":
        return [], False, None
    if choice == "auto":
        return tools, False, None
    if choice == "required":
        return tools, True, None
    function = choice.get("function") if isinstance(choice, dict) else None
    if not (
        isinstance(choice, dict) and choice.get("type") == "function" and isinstance(function, dict)
    ):
        raise bad(
            'tool_choice: "auto", "none", "required" or {"type": "function", "function": '
            '{"name": ...}}',
            "tool_choice",
        )
    name = function.get("name")
    return named_tool(tools, name), True, name


def stops(body: dict[str, Any], limits: Limits, name: str = "stop") -> list[str]:
    stop = body.get(name)
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad(f"{name} must be a non-empty string or a list of them", name)
    if len(stops) > limits.stops or any(len(s) > limits.stop_chars for s in stops):
        raise bad(f"{name}: at most {limits.stops} strings of {limits.stop_chars} characters", name)
    return stops


def read_doc(body: bytes, models: set[str]) -> dict[str, Any]:
    """The body as a JSON object whose `model` (if any) names the loaded model;
    ApiError (400, or 404 for another model) otherwise.

    `models` are the names that select the loaded model: a request never names a path
    or anything else to load.
    """
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError) as err:
        raise bad(f"the body is not valid JSON: {err}") from None
    except RecursionError:
        raise bad(f"the body nests arrays or objects more than {MAX_DEPTH} deep") from None
    if not isinstance(doc, dict):
        raise bad("the body must be a JSON object")
    check_text(body, doc)
    model = doc.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("model must be a string", "model")
    if model is not None and model not in models:
        raise unknown_model(model, models)
    return doc


def unknown_model(name: str, models: set[str]) -> ApiError:
    """The 404 of a model name that is not the loaded model's, as OpenAI words it."""
    served = ", ".join(sorted(models))
    return ApiError(
        404,
        f"The model {name!r} does not exist: this server serves {served}",
        param="model",
        code="model_not_found",
    )


# For the checks of a body's text, on its bytes (C-speed; a walk of the document in
# Python takes several times json.loads's time on a body of small arrays): its strings,
# every byte but a bracket, a pair of brackets with nothing between.
_STRING = re.compile(rb'"[^"]*"')  # once its escaped backslashes and quotes are gone
_NOT_BRACKET = bytes(sorted(set(range(256)) - set(b"[]{}")))
_EMPTY_PAIR = re.compile(rb"\[\]|\{\}")


def check_text(body: bytes, doc: dict[str, Any]) -> None:
    """400 for a body (`doc` as read from `body`) nested more than MAX_DEPTH deep, or
    with a string (a key or a value) that is not Unicode text: a lone surrogate sent as
    a JSON escape (`"a\\ud800b"`), which json.loads takes and no tokenizer can encode.
    The error says where (`messages[0].content`), its `param` the top-level field."""
    # In valid JSON a backslash is only ever an escape's, in a string: taken left to
    # right, `\\` pairs first, what is left of the strings has no quote inside.
    unescaped = body.replace(b"\\\\", b"").replace(b'\\"', b"")
    brackets = _STRING.sub(b"", unescaped).translate(None, _NOT_BRACKET)
    for _ in range(MAX_DEPTH + 1):  # the body's own object, and MAX_DEPTH inside it
        if not brackets:
            break
        brackets = _EMPTY_PAIR.sub(b"", brackets)  # the innermost level, everywhere
    if brackets:
        raise bad(f"the body nests arrays or objects more than {MAX_DEPTH} deep")
    # A surrogate comes only from an escape \uD800-\uDFFF; a body without one of
    # \ud... (Hangul's too: then the walk finds nothing) has none.
    if b"\\ud" in body or b"\\uD" in body:
        _find_lone_surrogate(doc)


def _find_lone_surrogate(doc: dict[str, Any]) -> None:
    """400 naming the first string of `doc` with a lone surrogate, if any."""
    # Each container with how it was reached (its parent's entry and its key), so that
    # a path is built only for the error.
    stack: list[tuple[Any, Any, Any]] = [(doc, None, None)]
    while stack:
        entry = stack.pop()
        value = entry[0]
        pairs = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in pairs:
            if isinstance(key, str) and not key.isascii():
                _unicode(key, entry, key)
            if isinstance(item, str):
                if not item.isascii():
                    _unicode(item, entry, key)
            elif isinstance(item, (dict, list)):
                stack.append((item, entry, key))


def _unicode(text: str, parent: tuple[Any, Any, Any], key: Any) -> None:
    """400 naming where `text` is (`parent`'s `key`) if it cannot be encoded as UTF-8;
    its `param`: the top-level field it is in."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        keys = [key]
        while parent[1] is not None:  # up to the body
            keys.append(parent[2])
            parent = parent[1]
        keys.reverse()
        where = "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in keys)[1:]
        where = where.encode("utf-8", "backslashreplace").decode()  # a key may hold it
        raise bad(
            f"{where} has a lone surrogate (U+{ord(text[err.start]):04X}) at character "
            f"{err.start}: not valid Unicode text",
            str(keys[0]).encode("utf-8", "backslashreplace").decode(),
        ) from None


def refuse_unapplied(doc: dict[str, Any]) -> None:
    """400 for a parameter this server takes but does not apply, set to anything but
    the value that changes nothing (0, {}): a reply that ignored it would look as if
    it had been applied."""
    for name in ("presence_penalty", "frequency_penalty"):
        if _number(doc, name, -2.0, 2.0, 0.0) != 0:
            raise bad(f"{name} is not supported by this server (0 or leave it out)", name)
    bias = doc.get("logit_bias")
    if bias is not None and not isinstance(bias, dict):
        raise bad("logit_bias must be an object of token ids and biases", "logit_bias")
    if bias:
        raise bad("logit_bias is not supported by this server ({} or leave it out)", "logit_bias")
    if doc.get("reasoning_effort") is not None:
        raise bad(
            "reasoning_effort is not supported by this server: its chat templates take no "
            "reasoning effort (leave it out)",
            "reasoning_effort",
        )


def sampling(
    doc: dict[str, Any], defaults: Defaults, limits: Limits, names: tuple[str, ...]
) -> dict[str, Any]:
    """The fields every API shares, checked: ChatCall's keyword arguments but messages.
    `names`: the reply-length fields, first found wins (max_completion_tokens, ...)."""
    max_tokens, name = None, names[-1]
    for name in names:
        max_tokens = whole(doc, name)
        if max_tokens is not None:
            break
    if max_tokens is not None and not 1 <= max_tokens <= limits.reply_tokens:
        raise bad(f"{name} must be between 1 and {limits.reply_tokens:,}", name)
    seed = whole(doc, "seed")
    stream = doc.get("stream", False)
    if not isinstance(stream, bool):
        raise bad("stream must be true or false", "stream")
    options = doc.get("stream_options")
    if options is not None and (not isinstance(options, dict) or not stream):
        raise bad("stream_options is an object, and only with stream: true", "stream_options")
    refuse_unapplied(doc)
    return dict(
        max_tokens=max_tokens if max_tokens is not None else defaults.max_tokens,
        temperature=_number(doc, "temperature", 0.0, 2.0, defaults.temperature),
        top_p=_number(doc, "top_p", 0.0, 1.0, 1.0),  # mlx-lm: 0 and 1 both mean off
        seed=None if seed is None else seed % SEED_RANGE,
        stream=stream,
        include_usage=bool((options or {}).get("include_usage")),
    )


def parse_chat(body: bytes, models: set[str], defaults: Defaults, limits: Limits) -> ChatCall:
    """The request's fields, checked; ApiError (400, or 404 for another model) otherwise."""
    doc = read_doc(body, models)
    if (whole(doc, "n") or 1) != 1:
        raise bad("n: only one choice per request is supported", "n")
    tools, forced, forced_name = _tools(doc)
    parallel = doc.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise bad("parallel_tool_calls must be true or false", "parallel_tool_calls")
    constraint = structured.response_format(doc)
    if constraint is not None and tools:
        raise bad(
            "response_format with tools: send one or the other (tool_choice none drops the tools)",
            "response_format",
        )
    messages = _messages(doc, limits)
    if defaults.system and messages[0]["role"] != "system":
        # As `ollama run` does: the model's SYSTEM when the request brings none.
        messages = [{"role": "system", "content": defaults.system}, *messages]
    fields = sampling(doc, defaults, limits, ("max_completion_tokens", "max_tokens"))
    return ChatCall(
        messages=messages,
        stop=stops(doc, limits),
        tools=tools,
        tool_messages=calls_tools(messages),
        forced=forced,
        forced_name=forced_name,
        parallel=parallel,
        grammar=constraint,
        logprobs=structured.chat_logprobs(doc),
        **fields,
    )


def conversation_name(messages: list[dict[str, str]]) -> str:
    """The session a request's turns are stored and cached under: named by how the
    conversation opens (its system prompt and first user message), so each call of one
    conversation lands in the same session; 'api-' keeps them apart from the chat's."""
    opening: list[dict[str, str]] = []
    for m in messages:
        opening.append(m)
        if m["role"] == "user":
            break
    digest = hashlib.sha256(json.dumps(opening, sort_keys=True).encode()).hexdigest()
    return f"api-{digest[:10]}"


# -- replies ----------------------------------------------------------------------


def usage(result: Any) -> dict[str, Any]:
    """OpenAI's usage of a turn (a TurnResult)."""
    prompt, generated = result.prompt_tokens, result.generated_tokens
    return {
        "prompt_tokens": prompt,
        "completion_tokens": generated,
        "total_tokens": prompt + generated,
        "prompt_tokens_details": {"cached_tokens": result.cached_tokens},
    }


def usage_of_broken(job: Any) -> dict[str, Any]:
    """The usage a stream that cannot finish ends with (the client asked for one): its
    turn's, or zeros when the ranks failed before reporting any."""
    if job.result is not None:
        return usage(job.result)
    zero = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    return {**zero, "prompt_tokens_details": {"cached_tokens": 0}}


def envelope(ident: str, kind: str, model: str) -> dict[str, Any]:
    """What every OpenAI reply document, whole or streamed, starts with."""
    return {"id": ident, "object": kind, "created": int(time.time()), "model": model}


def finish_reason(engine_reason: str, stopped_by_text: bool) -> str:
    """OpenAI's finish_reason from the engine's ('stop', 'length', 'interrupted')."""
    if stopped_by_text or engine_reason == "stop":
        return "stop"
    return "length"


def completion(
    ident: str, model: str, text: str, finish: str, used: dict[str, Any]
) -> dict[str, Any]:
    return {
        **envelope(ident, "chat.completion", model),
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": finish,
            }
        ],
        "usage": used,
    }


def chunk(
    ident: str,
    model: str,
    delta: dict[str, Any] | None,
    finish: str | None = None,
    used: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One server-sent event's data: a delta, the final finish_reason, or (with
    stream_options.include_usage) the usage, with no choices, as OpenAI sends it."""
    doc: dict[str, Any] = {
        **envelope(ident, "chat.completion.chunk", model),
        "choices": []
        if delta is None
        else [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
    }
    if used is not None:
        doc["usage"] = used
    return doc


def sse(doc: dict[str, Any] | str) -> bytes:
    data = doc if isinstance(doc, str) else json.dumps(doc, ensure_ascii=False)
    return f"data: {data}\n\n".encode()


class ReplyShape:
    """What every API's reply shape starts from: the model, the call, the reply's id,
    and errors in OpenAI's shape (an API with its own overrides `error_doc`)."""

    PREFIX = ""  # the reply id's
    media_type = "text/event-stream"  # a stream's (server-sent events, but Ollama's)

    def __init__(self, model: str, call: ChatCall) -> None:
        self.model = model
        self.call = call
        self.stream = call.stream
        self.ident = f"{self.PREFIX}{secrets.token_hex(12)}"

    def error_doc(self, err: ApiError) -> dict[str, Any]:
        return err.doc()

    def keepalive(self) -> bytes:
        """What a stream sends while nothing else is sent (a long prefill): a comment."""
        return b": keep-alive\n\n"


class ToolsShape(ReplyShape):
    """What the chat APIs' reply shapes share: the request's tools checked against the
    model, the marker message that renders them, and the reader of calls in the text."""

    def __init__(self, model: str, call: ChatCall, tools: ModelTools | None = None) -> None:
        super().__init__(model, call)
        asked = bool(call.tools) or call.tool_messages
        self._messages = call.messages
        if asked and generic_tools.needed(tools, call.forced, call.forced_name):
            self._generic(call)
            return
        check(tools, model, asked)
        self._marker = [tools_message(call.tools)] if call.tools else []
        # A forced call: the reply starts as the call's opening (rendered after the
        # generation prompt), which the reader of calls reads before the reply's text.
        held = tools.call_grammar(call.tools, call.forced_name) if call.forced and tools else None
        if held is not None:  # the arguments and the call's end held by a grammar
            call.grammar = held
            opening = tools.held_opening(call.forced_name) or ""
        else:
            opening = forced_opening(tools, model, call) if call.forced else ""
        self._prefix = [reply_prefix(opening)] if opening else []

        def new_text() -> ToolText:
            reader = ToolText(tools, call.tools)
            reader.feed(opening)  # what it holds before the start marker is not said
            return reader

        self._text = new_text() if call.tools else None
        self._new_text = new_text

    def _generic(self, call: ChatCall) -> None:
        """Tools in the generic format (exokv.serve.generic_tools): offered in the
        system prompt, the reply held to their JSON by the call's grammar."""
        self._marker, self._prefix = [], []
        self._messages = generic_tools.messages(call.messages, call.tools, call.forced)
        if call.tools:
            try:
                call.grammar = grammar.generic_tools(call.tools, call.forced, call.parallel)
            except grammar.GrammarError as err:
                said = f"tools: a function's parameters cannot be enforced: {err}"
                raise bad(said, "tools") from None
        self._new_text = generic_tools.GenericText  # type: ignore[assignment]
        self._text = generic_tools.GenericText() if call.tools else None

    def turn_messages(self) -> list[dict[str, Any]]:
        """The messages the turn renders: the request's, with the markers it needs."""
        return self._marker + self._messages + self._prefix

    def read_whole(self, reply: str) -> tuple[str, list[dict[str, Any]]]:
        """A whole reply's text and the tool calls it makes (none without tools), read
        by a reader of its own: the stream's reader is left as it is."""
        if self._text is None:
            return reply, []
        reader = self._new_text()
        said, calls = reader.feed(reply)
        rest, more = reader.flush()
        return said + rest, calls + more


class ChatShape(ToolsShape):
    """POST /v1/chat/completions's reply: a chat.completion, or its chunks streamed."""

    PREFIX = "chatcmpl-"

    def _finish(self, job: Any, result: Any, calls: bool = False) -> str:
        return "tool_calls" if calls else finish_reason(result.finish_reason, job.stop_text.hit)

    def whole(self, job: Any, result: Any) -> dict[str, Any]:
        text, calls = self.read_whole(job.reply)
        finish = self._finish(job, result, bool(calls))
        doc = completion(self.ident, self.model, text, finish, usage(result))
        if result.logprobs is not None:
            doc["choices"][0]["logprobs"] = structured.chat_content(result.logprobs)
        if calls:
            doc["choices"][0]["message"]["tool_calls"] = calls
            doc["choices"][0]["message"]["content"] = text or None
        return doc

    def opening(self) -> list[bytes]:
        return [sse(chunk(self.ident, self.model, {"role": "assistant", "content": ""}))]

    def _deltas(self, text: str, calls: list[dict[str, Any]]) -> list[bytes]:
        out = [sse(chunk(self.ident, self.model, {"content": text}))] if text else []
        assert self._text is not None
        first = len(self._text.calls) - len(calls)
        for n, call in enumerate(calls):  # each call whole, at its index (as OpenAI)
            delta = {"tool_calls": [{"index": first + n, **call}]}
            out.append(sse(chunk(self.ident, self.model, delta)))
        return out

    def piece(self, text: str) -> list[bytes]:
        if self._text is None:
            return [sse(chunk(self.ident, self.model, {"content": text}))]
        return self._deltas(*self._text.feed(text))

    def closing(self, job: Any, result: Any) -> list[bytes]:
        out: list[bytes] = []
        if self._text is not None:
            out = self._deltas(*self._text.flush())
        calls = self._text is not None and bool(self._text.calls)
        last = chunk(self.ident, self.model, {}, self._finish(job, result, calls))
        if result.logprobs is not None:  # the ranks report them with the turn's result
            last["choices"][0]["logprobs"] = structured.chat_content(result.logprobs)
        out.append(sse(last))
        if self.call.include_usage:
            out.append(sse(chunk(self.ident, self.model, None, used=usage(result))))
        return out + [sse("[DONE]")]

    def broken(self, err: ApiError, job: Any) -> list[bytes]:
        # The error event first (OpenAI's clients raise on it), then the end a reader
        # that ignores it still sees: a finish_reason (cut short: "length"), [DONE].
        out = [sse(err.doc()), sse(chunk(self.ident, self.model, {}, "length"))]
        if self.call.include_usage:
            out.append(sse(chunk(self.ident, self.model, None, used=usage_of_broken(job))))
        return out + [sse("[DONE]")]
