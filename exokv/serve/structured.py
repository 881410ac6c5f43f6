"""OpenAI's `response_format` and `logprobs`, read from a request and written back.

`response_format` becomes the grammar the ranks' sampler enforces
(exokv.prompt.grammar): `json_object` any JSON object, `json_schema` its schema
(`strict` or not: the schema is enforced either way); a schema the grammar library
cannot enforce is a 400 naming the keyword. `logprobs` (with `top_logprobs`) asks the
ranks for each token's log-probability (exokv.rank.constrain), written here in chat
completions' and legacy completions' shapes.
"""

from __future__ import annotations

from typing import Any

from exokv.prompt import grammar
from exokv.serve.errors import ApiError

MOST_TOP_LOGPROBS = 20  # as OpenAI


def _bad(message: str, param: str) -> ApiError:
    return ApiError(400, message, param=param)


def response_format(doc: dict[str, Any]) -> str | None:
    """The grammar a chat request's `response_format` asks for (None: free text)."""
    value = doc.get("response_format")
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return grammar.any_object()
    if kind != "json_schema":
        raise _bad(
            'response_format: {"type": "text"}, {"type": "json_object"} or '
            '{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}',
            "response_format",
        )
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
        raise _bad("response_format.json_schema: an object with a schema object", "response_format")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise _bad("response_format.json_schema.strict must be true or false", "response_format")
    try:
        return grammar.from_schema(spec.get("schema", {}))
    except grammar.GrammarError as err:
        raise _bad(
            f"response_format.json_schema.schema cannot be enforced: {err}", "response_format"
        ) from None


def chat_logprobs(doc: dict[str, Any]) -> int | None:
    """How many most likely tokens a chat request wants with each token's logprob
    (`logprobs: true`, `top_logprobs` 0-20); None: no logprobs."""
    wanted = doc.get("logprobs")
    top = doc.get("top_logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise _bad("logprobs must be true or false", "logprobs")
    if top is not None and (
        isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MOST_TOP_LOGPROBS
    ):
        raise _bad(f"top_logprobs must be an integer from 0 to {MOST_TOP_LOGPROBS}", "top_logprobs")
    if top is not None and not wanted:
        raise _bad("top_logprobs needs logprobs: true", "top_logprobs")
    return (top or 0) if wanted else None


def completion_logprobs(doc: dict[str, Any]) -> int | None:
    """A legacy completion's `logprobs`: how many most likely tokens (0-20); None: none."""
    value = doc.get("logprobs")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MOST_TOP_LOGPROBS:
        raise _bad(f"logprobs must be an integer from 0 to {MOST_TOP_LOGPROBS}", "logprobs")
    return value


def _token(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", "replace"))}


def chat_content(entries: list[Any]) -> dict[str, Any]:
    """A chat choice's `logprobs` from the ranks' reports (TurnResult.logprobs)."""
    return {
        "content": [
            {**_token(text, lp), "top_logprobs": [_token(t, v) for t, v in top]}
            for text, lp, top in entries
        ],
        "refusal": None,
    }


def completion_content(entries: list[Any], offset: int = 0) -> dict[str, Any]:
    """A legacy completion choice's `logprobs`: tokens, token_logprobs, top_logprobs
    (a {token: logprob} per token) and each token's text_offset from `offset`."""
    offsets = []
    for text, _, _ in entries:
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": [text for text, _, _ in entries],
        "token_logprobs": [lp for _, lp, _ in entries],
        "top_logprobs": [dict(top) for _, _, top in entries],
        "text_offset": offsets,
    }
