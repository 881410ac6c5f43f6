"""The Ollama API: /api/chat and /api/generate over the same turn path as OpenAI's chat,
and /api/tags, /api/show, /api/ps, /api/version about the one model served.

Replies stream as Ollama writes them, newline-delimited JSON: lines of
{"model", "created_at", "message"|"response", "done": false}, then a last line with
"done": true, "done_reason" and the timings (nanoseconds) and token counts; with
`"stream": false` the last line alone, holding the whole reply. Ollama's `options`
num_predict, temperature, top_p, seed and stop are applied; num_ctx and the options
of Ollama's own runtime (threads, GPU layers, ...) are accepted and change nothing
(the context is the model's); the sampler options this server does not have are
refused unless they say "off". `format` ("json" or a JSON schema) holds the reply to
it with the grammar chat's response_format uses. Errors are {"error": "..."}.
"""

from __future__ import annotations

import functools
import hashlib
import json
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from exokv.prompt import grammar
from exokv.prompt.markers import raw_prompt
from exokv.serve import api
from exokv.serve.tools import ModelTools, model_files

MEDIA_TYPE = "application/x-ndjson"
# The Ollama API version /api/version reports: the one whose endpoints and fields this
# server speaks. Clients gate features on it (VS Code's Copilot wants 0.6.4 or later).
VERSION = "0.9.0"
CHAT_ROLES = ("system", "user", "assistant", "tool")
# Sampler options this server does not apply, and the value of each that means off.
SAMPLER_OFF = {
    "top_k": 0,
    "min_p": 0.0,
    "typical_p": 1.0,
    "tfs_z": 1.0,
    "repeat_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "mirostat": 0,
}
# Options of Ollama's runtime: no effect on a reply's text, none here.
RUNTIME = {
    "num_ctx", "num_keep", "num_batch", "num_gpu", "main_gpu", "num_thread", "numa",
    "low_vram", "f16_kv", "logits_all", "vocab_only", "use_mmap", "use_mlock",
    "embedding_only", "repeat_last_n", "mirostat_tau", "mirostat_eta", "penalize_newline",
}  # fmt: skip
APPLIED = {"num_predict", "temperature", "top_p", "seed", "stop"}


class Loaded(api.ApiError):
    """A request with no messages (or no prompt): Ollama's way to load the model. It is
    answered at once (status 200, `doc`) through the path that answers before a turn
    is queued; the model is loaded already."""

    def __init__(self, doc: dict[str, Any]) -> None:
        super().__init__(200, "loaded")
        self.doc = doc


def error_doc(err: api.ApiError) -> dict[str, Any]:
    return err.doc if isinstance(err, Loaded) else {"error": err.message}


def names(served: set[str]) -> set[str]:
    """What a request's model may say: the served names, and each with Ollama's
    default tag (`name:latest`) where it has no tag."""
    return served | {f"{n}:latest" for n in served if ":" not in n.rpartition("/")[2]}


def now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


@dataclass
class OllamaCall(api.ChatCall):
    """One checked /api/chat or /api/generate: the chat call its turn runs, the model
    name its lines echo, and which of the two it is."""

    name: str = ""
    chat: bool = True  # /api/chat's "message" lines; else /api/generate's "response"


def _format(doc: dict[str, Any]) -> str | None:
    """The grammar `format` ("json" or a JSON schema) holds the reply to; None: free
    text. A schema the grammar cannot enforce is a 400 naming the keyword."""
    value = doc.get("format")
    if value in (None, ""):
        return None
    if doc.get("tools"):
        raise api.bad("format and tools cannot be asked together: send one")
    try:
        return grammar.from_format(value)
    except grammar.GrammarError as err:
        raise api.bad(f"format cannot be enforced: {err}") from None


def _checked(doc: dict[str, Any], defaults: api.Defaults, limits: api.Limits) -> dict[str, Any]:
    """The fields every Ollama request shares, checked: ChatCall's keyword arguments
    but messages and tools, from `options`, `stream` (true unless said), `format`,
    `think` and `keep_alive` (accepted: the model stays loaded while the server runs)."""
    held = _format(doc)
    if doc.get("think"):
        raise api.bad("think is not supported by this server's models")
    if not isinstance(doc.get("keep_alive", 0), (int, float, str)):
        raise api.bad("keep_alive must be a duration ('5m') or a number of seconds")
    options = doc.get("options") or {}
    if not isinstance(options, dict):
        raise api.bad("options must be an object")
    for name, value in options.items():
        if name in SAMPLER_OFF and value is not None and value != SAMPLER_OFF[name]:
            raise api.bad(
                f"options.{name} is not supported by this server (it applies "
                f"{', '.join(sorted(APPLIED))}); leave it out or set it to {SAMPLER_OFF[name]}"
            )
        if name not in SAMPLER_OFF and name not in RUNTIME and name not in APPLIED:
            raise api.bad(f"options.{name} is not an option this server knows")
    sampled = {k: v for k, v in options.items() if k in APPLIED and v is not None}
    if sampled.get("num_predict") in (-1, -2):  # until the model stops (or fills the context)
        sampled["num_predict"] = limits.reply_tokens
    fields = api.sampling(
        {**sampled, "stream": doc.get("stream", True)}, defaults, limits, ("num_predict",)
    )
    fields["stop"] = api.stops(sampled, limits)
    fields["grammar"] = held
    return fields


def _tools(doc: dict[str, Any]) -> list[dict[str, Any]]:
    tools = doc.get("tools") or []
    if not isinstance(tools, list) or not all(
        isinstance(t, dict)
        and isinstance(t.get("function"), dict)
        and isinstance(t["function"].get("name"), str)
        for t in tools
    ):
        raise api.bad("tools: a list of {type: function, function: {name, ...}}")
    return [{**t, "type": "function"} for t in tools]


def _message(message: Any, i: int, limits: api.Limits) -> dict[str, Any]:
    if not isinstance(message, dict) or message.get("role") not in CHAT_ROLES:
        raise api.bad(f"messages[{i}].role: use system, user, assistant or tool")
    if message.get("images"):
        raise api.bad(f"messages[{i}].images: this server's models read text only")
    entry: dict[str, Any] = {
        "role": message["role"],
        "content": api.content({**message, "content": message.get("content") or ""}, i, limits),
    }
    if message["role"] == "tool":
        entry["tool_call_id"] = str(message.get("tool_call_id") or "")
    calls = message.get("tool_calls")
    if message["role"] == "assistant" and calls:
        if not isinstance(calls, list) or not all(
            isinstance(c, dict) and isinstance(c.get("function"), dict) for c in calls
        ):
            raise api.bad(f"messages[{i}].tool_calls: a list of {{function: {{name, arguments}}}}")
        made = [
            {
                "id": str(c.get("id") or ""),
                "type": "function",
                "function": {
                    "name": str(c["function"].get("name", "")),
                    "arguments": c["function"].get("arguments") or {},
                },
            }
            for c in calls
        ]
        entry["tool_calls"] = json.dumps(made, sort_keys=True, ensure_ascii=False)
    return entry


def _load_doc(name: str, chat: bool) -> dict[str, Any]:
    body = {"message": {"role": "assistant", "content": ""}} if chat else {"response": ""}
    return {"model": name, "created_at": now(), **body, "done_reason": "load", "done": True}


def parse_chat(
    body: bytes, models: set[str], defaults: api.Defaults, limits: api.Limits
) -> OllamaCall:
    """A checked /api/chat request; Loaded for one with no messages."""
    doc = api.read_doc(body, names(models))
    name = doc.get("model") or ""
    fields = _checked(doc, defaults, limits)
    raw = doc.get("messages")
    if not raw:
        raise Loaded(_load_doc(name, chat=True))
    messages = [_message(m, i, limits) for i, m in enumerate(api.message_list(doc, limits))]
    if messages[-1]["role"] not in ("user", "tool"):
        raise api.bad("the last message must be the user's (or a tool's result)")
    if defaults.system and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": defaults.system})
    tools = _tools(doc)
    return OllamaCall(
        messages=messages,
        tools=tools,
        tool_messages=api.calls_tools(messages),
        name=name,
        chat=True,
        **fields,
    )


def parse_generate(
    body: bytes, models: set[str], defaults: api.Defaults, limits: api.Limits
) -> OllamaCall:
    """A checked /api/generate request; Loaded for one with no prompt."""
    doc = api.read_doc(body, names(models))
    name = doc.get("model") or ""
    fields = _checked(doc, defaults, limits)
    for field in ("suffix", "template", "context", "images"):
        if doc.get(field):
            raise api.bad(f"{field} is not supported by this server")
    prompt, system = doc.get("prompt") or "", doc.get("system")
    if not isinstance(prompt, str) or not isinstance(system, (str, type(None))):
        raise api.bad("prompt and system must be strings")
    if not prompt:
        raise Loaded(_load_doc(name, chat=False))
    if len(prompt) > limits.message_chars:
        raise api.bad(f"prompt is {len(prompt):,} characters; at most {limits.message_chars:,}")
    if doc.get("raw"):
        if system:
            raise api.bad("a raw prompt takes no system: put it in the prompt")
        messages = raw_prompt(prompt)
    else:
        system = system if system is not None else defaults.system
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": prompt})
    return OllamaCall(messages=messages, name=name, chat=False, **fields)


def _nanoseconds(seconds: float) -> int:
    return int(max(0.0, seconds) * 1e9)


def stats(job: Any, result: Any) -> dict[str, Any]:
    """The last line's timings and counts, as Ollama names them (the model is loaded
    before the server serves: no load time)."""
    decoding = result.generated_tokens / result.decode_tps if result.decode_tps > 0 else 0.0
    return {
        "total_duration": _nanoseconds(time.perf_counter() - job.submitted),
        "load_duration": 0,
        "prompt_eval_count": result.prompt_tokens,
        "prompt_eval_duration": _nanoseconds(result.ttft_s),
        "eval_count": result.generated_tokens,
        "eval_duration": _nanoseconds(decoding),
    }


def _tool_call(call: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI-shaped parsed call as Ollama's (its arguments an object)."""
    try:
        arguments = json.loads(call["function"]["arguments"])
    except ValueError:
        arguments = {}
    return {"function": {"name": call["function"]["name"], "arguments": arguments}}


class Shape(api.ToolsShape):
    """The reply: one JSON object, or Ollama's stream of JSON lines."""

    media_type = MEDIA_TYPE

    def __init__(self, model: str, call: OllamaCall, tools: ModelTools | None = None) -> None:
        super().__init__(model, call, tools)
        self.name = call.name or model  # Ollama echoes the name it was asked for
        self.chat = call.chat

    def error_doc(self, err: api.ApiError) -> dict[str, Any]:
        return error_doc(err)

    def _doc(self, text: str, calls: list[dict[str, Any]] | None = None, **more: Any) -> dict:
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if calls:
                message["tool_calls"] = [_tool_call(c) for c in calls]
            body: dict[str, Any] = {"message": message}
        else:
            body = {"response": text}
        return {"model": self.name, "created_at": now(), **body, **more}

    @staticmethod
    def _line(doc: dict[str, Any]) -> bytes:
        return (json.dumps(doc, ensure_ascii=False, separators=(",", ":")) + "\n").encode()

    def _last(self, job: Any, result: Any, text: str, calls: list[dict[str, Any]]) -> dict:
        stopped = api.finish_reason(result.finish_reason, job.stop_text.hit) == "stop"
        reason = "stop" if stopped or calls else "length"
        return self._doc(text, calls, done=True, done_reason=reason, **stats(job, result))

    def whole(self, job: Any, result: Any) -> dict[str, Any]:
        return self._last(job, result, *self.read_whole(job.reply))

    def keepalive(self) -> bytes:
        return self._line(self._doc("", done=False))  # NDJSON has no comments: an empty piece

    def opening(self) -> list[bytes]:
        return []

    def _said(self, text: str, calls: list[dict[str, Any]]) -> list[bytes]:
        if not text and not calls:
            return []
        return [self._line(self._doc(text, calls, done=False))]

    def piece(self, text: str) -> list[bytes]:
        return self._said(*(self._text.feed(text) if self._text is not None else (text, [])))

    def closing(self, job: Any, result: Any) -> list[bytes]:
        out = self._said(*self._text.flush()) if self._text is not None else []
        calls = self._text.calls if self._text is not None else []
        last = self._last(job, result, "", [])
        if calls:
            last["done_reason"] = "stop"
        return out + [self._line(last)]

    def broken(self, err: api.ApiError, job: Any) -> list[bytes]:
        return [self._line({"error": err.message})]  # the ollama client raises on it


# -- the model, as Ollama lists it ----------------------------------------------------


@functools.lru_cache(maxsize=4)
def model_card(shown: str, served: frozenset[str]) -> dict[str, Any]:
    """The served model's entry in /api/tags: its size, digest and details, read from
    its files on this machine (none found: the name alone)."""
    # deferred: the catalogue imports mlx; only an Ollama client's listing needs it
    from exokv.model.catalogue import quantization_of

    config: dict[str, Any] = {}
    size, modified = 0, 0.0
    for name in sorted(served, key=lambda n: n != shown):
        try:
            path = model_files(name)
            config = json.loads((path / "config.json").read_text())
        except Exception:  # noqa: BLE001 - a name that is not a local model: try the next
            continue
        weights = list(path.glob("*.safetensors"))
        size = sum(f.stat().st_size for f in weights)
        modified = (path / "config.json").stat().st_mtime
        break
    quantization = quantization_of(config) if config else None
    digest = hashlib.sha256(json.dumps([shown, config], sort_keys=True).encode()).hexdigest()
    details = {
        "parent_model": "",
        "format": "safetensors",
        "family": config.get("model_type", ""),
        "families": [config["model_type"]] if config.get("model_type") else None,
        "parameter_size": "",
        "quantization_level": quantization or str(config.get("torch_dtype", "")).upper(),
    }
    return {
        "name": shown,
        "model": shown,
        "modified_at": datetime.fromtimestamp(modified, timezone.utc).isoformat(),
        "size": size,
        "digest": digest,
        "details": details,
        "context_length": config.get("max_position_embeddings"),
    }


def tags(card: dict[str, Any]) -> dict[str, Any]:
    entry = {k: v for k, v in card.items() if k != "context_length"}
    return {"models": [entry]}


def running(card: dict[str, Any]) -> dict[str, Any]:
    """/api/ps: the model, loaded until the server stops (expires_at: far ahead)."""
    entry = {k: v for k, v in card.items() if k != "modified_at"}
    entry |= {"expires_at": "2318-01-01T00:00:00Z", "size_vram": card["size"]}
    return {"models": [entry]}


def show(
    body: bytes, card: dict[str, Any], served: set[str], tools: ModelTools | None
) -> dict[str, Any]:
    """/api/show: the model's details; 404 for a name that is not the served model's."""
    doc = api.read_doc(body or b"{}", names(served))  # another model: 404
    name = doc.get("model") or doc.get("name")  # Ollama's older clients send "name"
    if name not in names(served):
        raise api.ApiError(404, f"model {name!r} not found: this server serves {card['name']!r}")
    capabilities = ["completion"] + (["tools"] if tools is not None and tools.template else [])
    architecture = card["details"]["family"] or "unknown"
    info: dict[str, Any] = {"general.architecture": architecture}
    if card["context_length"]:
        info[f"{architecture}.context_length"] = card["context_length"]
    return {
        "modelfile": f"# served by exokv\nFROM {card['name']}\n",
        "parameters": "",
        "template": "",
        "details": card["details"],
        "model_info": info,
        "capabilities": capabilities,
        "modified_at": card["modified_at"],
    }
