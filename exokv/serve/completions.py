"""POST /v1/completions: OpenAI's legacy completions, a prompt in and its continuation out.

The prompt is not templated: it travels as exokv.prompt.markers's raw prompt through the
same turn path as a chat, cached in the same prefix tree (a prompt that starts like
an earlier one is served from the cache as far as they agree).
"""

from __future__ import annotations

from typing import Any

from exokv.prompt.markers import raw_prompt
from exokv.serve import api, structured


def parse(
    body: bytes, models: set[str], defaults: api.Defaults, limits: api.Limits
) -> api.ChatCall:
    doc = api.read_doc(body, models)
    prompt = doc.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise api.bad("prompt must be a non-empty string (one prompt per request)", "prompt")
    if len(prompt) > limits.message_chars:
        raise api.bad(
            f"prompt is {len(prompt):,} characters; at most {limits.message_chars:,}", "prompt"
        )
    if (api.whole(doc, "n") or 1) != 1 or (api.whole(doc, "best_of") or 1) != 1:
        raise api.bad("n and best_of: only one choice per request is supported", "n")
    for name in ("echo", "suffix"):
        if doc.get(name):
            raise api.bad(f"{name} is not supported by this server", name)
    fields = api.sampling(doc, defaults, limits, ("max_tokens",))
    return api.ChatCall(
        messages=raw_prompt(prompt),
        stop=api.stops(doc, limits),
        logprobs=structured.completion_logprobs(doc),
        **fields,
    )


def _doc(ident: str, model: str, text: str, finish: str | None) -> dict[str, Any]:
    return {
        **api.envelope(ident, "text_completion", model),
        "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish}],
    }


class Shape(api.ReplyShape):
    """The reply: a text_completion, or its chunks streamed (as OpenAI streams them)."""

    PREFIX = "cmpl-"
    prompt_field = "prompt"  # what a too-long prompt's 400 names

    def whole(self, job: Any, result: Any) -> dict[str, Any]:
        finish = api.finish_reason(result.finish_reason, job.stop_text.hit)
        doc = _doc(self.ident, self.model, job.reply, finish)
        if result.logprobs is not None:
            doc["choices"][0]["logprobs"] = structured.completion_content(result.logprobs)
        return {**doc, "usage": api.usage(result)}

    def opening(self) -> list[bytes]:
        return []

    def piece(self, text: str) -> list[bytes]:
        return [api.sse(_doc(self.ident, self.model, text, None))]

    def _used(self, used: dict[str, Any]) -> list[bytes]:
        if not self.call.include_usage:
            return []
        doc = {**_doc(self.ident, self.model, "", None), "choices": []}
        return [api.sse({**doc, "usage": used})]

    def closing(self, job: Any, result: Any) -> list[bytes]:
        finish = api.finish_reason(result.finish_reason, job.stop_text.hit)
        doc = _doc(self.ident, self.model, "", finish)
        if result.logprobs is not None:  # the ranks report them with the turn's result
            doc["choices"][0]["logprobs"] = structured.completion_content(result.logprobs)
        return [api.sse(doc), *self._used(api.usage(result)), api.sse("[DONE]")]

    def broken(self, err: api.ApiError, job: Any) -> list[bytes]:
        last = api.sse(_doc(self.ident, self.model, "", "length"))
        used = self._used(api.usage_of_broken(job))
        return [api.sse(err.doc()), last, *used, api.sse("[DONE]")]
