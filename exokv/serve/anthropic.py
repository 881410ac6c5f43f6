"""POST /v1/messages: Anthropic's Messages API over the same turn path as OpenAI's chat.

`system` (a string or text blocks), `messages` of text content blocks, `max_tokens`
(required, as Anthropic requires it), `stop_sequences`, `temperature`, `top_p`,
`stream` with Anthropic's event types. `usage.cache_read_input_tokens` is what the
prefix cache served and `input_tokens` the rest, as Anthropic counts them; errors
come in Anthropic's shape, {"type": "error", "error": {"type", "message"}}.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

from exokv.serve import api

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
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
    body: bytes, models: set[str], defaults: api.Defaults, limits: api.Limits
) -> api.ChatCall:
    doc = api.read_doc(body, models)
    if api.whole(doc, "max_tokens") is None:
        raise api.bad("max_tokens: Field required", "max_tokens")
    if doc.get("tools"):
        raise api.bad("tools are not supported on /v1/messages by this server yet", "tools")
    raw = doc.get("messages")
    if not isinstance(raw, list) or not raw:
        raise api.bad("messages must be a non-empty list", "messages")
    if len(raw) > limits.messages:
        raise api.bad(f"{len(raw):,} messages; at most {limits.messages:,}", "messages")
    messages: list[dict[str, str]] = []
    if doc.get("system") is not None:
        messages.append({"role": "system", "content": _text(doc["system"], "system", limits)})
    for i, message in enumerate(raw):
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            raise api.bad(f"messages[{i}].role: use user or assistant", "messages")
        text = _text(message.get("content"), f"messages[{i}].content", limits)
        messages.append({"role": message["role"], "content": text})
    if messages[-1]["role"] != "user":
        raise api.bad("the last message must be the user's", "messages")
    fields = api.sampling(doc, defaults, limits, ("max_tokens",))
    fields["include_usage"] = True
    return api.ChatCall(messages=messages, stop=api.stops(doc, limits, "stop_sequences"), **fields)


def _event(kind: str, doc: dict[str, Any]) -> bytes:
    data = json.dumps({"type": kind, **doc}, ensure_ascii=False)
    return f"event: {kind}\ndata: {data}\n\n".encode()


class Shape:
    """The reply: a message, or Anthropic's stream of events."""

    def __init__(self, model: str, call: api.ChatCall) -> None:
        self.model = model
        self.call = call
        self.stream = call.stream
        self.ident = f"msg_{secrets.token_hex(12)}"

    def tools_messages(self) -> list[dict[str, Any]]:
        return []

    def error_doc(self, err: api.ApiError) -> dict[str, Any]:
        return error_doc(err)

    def _stop(self, job: Any, result: Any) -> dict[str, Any]:
        if job.stop_text.hit:
            return {"stop_reason": "stop_sequence", "stop_sequence": job.stop_text.which}
        reason = "end_turn" if result.finish_reason == "stop" else "max_tokens"
        return {"stop_reason": reason, "stop_sequence": None}

    @staticmethod
    def _usage(result: Any) -> dict[str, Any]:
        return {
            "input_tokens": result.prompt_tokens - result.cached_tokens,
            "output_tokens": result.generated_tokens,
            "cache_read_input_tokens": result.cached_tokens,
            "cache_creation_input_tokens": 0,
        }

    def _message(self, content: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.ident,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
        }

    def whole(self, job: Any, result: Any) -> dict[str, Any]:
        content = [{"type": "text", "text": job.reply}]
        return {**self._message(content), **self._stop(job, result), "usage": self._usage(result)}

    def opening(self) -> list[bytes]:
        usage = {"input_tokens": 0, "output_tokens": 0}  # known when the turn ends
        message = {**self._message([]), "stop_reason": None, "stop_sequence": None}
        return [
            _event("message_start", {"message": {**message, "usage": usage}}),
            _event(
                "content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}
            ),
        ]

    def piece(self, text: str) -> list[bytes]:
        delta = {"type": "text_delta", "text": text}
        return [_event("content_block_delta", {"index": 0, "delta": delta})]

    def closing(self, job: Any, result: Any) -> list[bytes]:
        return [
            _event("content_block_stop", {"index": 0}),
            _event(
                "message_delta", {"delta": self._stop(job, result), "usage": self._usage(result)}
            ),
            _event("message_stop", {}),
        ]

    def broken(self, err: api.ApiError, job: Any) -> list[bytes]:
        usage = self._usage(job.result) if job.result is not None else {"output_tokens": 0}
        stop = {"stop_reason": "max_tokens", "stop_sequence": None}
        return [
            _event("error", {"error": error_doc(err)["error"]}),
            _event("content_block_stop", {"index": 0}),
            _event("message_delta", {"delta": stop, "usage": usage}),
            _event("message_stop", {}),
        ]
