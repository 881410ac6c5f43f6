"""OpenAI tool calling through the model's own chat template and mlx-lm's tool parsers.

The request's `tools` reach the template as its `tools` argument (exokv.prompt.markers's
marker message, so every rank renders them alike), `role: "tool"` results and
assistant `tool_calls` as the template expects them; the reply's tool calls are
cut out of its text where the model's parser marks them (mlx-lm's
`tool_call_start`/`tool_call_end` and `parse_tool_call`, as mlx_lm.server reads them)
and returned as OpenAI's `tool_calls`, each streamed whole in one delta. A model whose
template does not read `tools` gets one clear 400.

A forced call (tool_choice required, or a named function) starts the reply as the
template writes a call (`ModelTools.opening`, read from the template's own renders of
an assistant's call): the text is put after the generation prompt (exokv.prompt.markers's
prefix marker), the model continues it, and the reader of calls reads the opening
before the reply's text.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from exokv.model import hub, templates
from exokv.model.resolve import resolve_model
from exokv.prompt import grammar
from exokv.prompt.markers import has_tools_support
from exokv.serve.errors import ApiError


@dataclass(frozen=True)
class ModelTools:
    """What the loaded model's tokenizer says of tool calling."""

    template: bool  # its chat template reads `tools`
    start: str | None = None  # the markers around a call in its output (mlx-lm's parser)
    end: str | None = None
    parser: Callable[..., Any] | None = None
    # How its template writes a call: the text before the function's name, and between
    # the name and the arguments (None: not found; a call cannot be forced).
    head: str | None = None
    mid: str | None = None
    # What the template writes after a call's arguments, up to its end marker (None:
    # not read): with it, a forced call's arguments are held by a grammar.
    tail: str | None = None

    def opening(self, name: str | None) -> str | None:
        """The text a reply that must call a tool starts with (the function `name`'s, or
        any one's: up to the name); None when this model's calls cannot be forced."""
        if self.head is None or self.mid is None or not (self.end and self.parser):
            return None
        return self.head if name is None else self.head + name + self.mid

    def held_opening(self, name: str | None) -> str | None:
        """The opening of a forced call whose rest a grammar holds (`call_grammar`): as
        `opening`, without the arguments' first brace (the grammar's JSON starts there)."""
        opening = self.opening(name)
        if opening is None or self.tail is None:
            return None
        return opening[:-1] if name is not None else opening

    def call_grammar(self, tools: list[dict[str, Any]], name: str | None) -> str | None:
        """The grammar of what a forced call writes after `held_opening`: the function's
        name (unless named), its arguments valid for its parameters, and the template's
        text up to the call's end marker. None: not known, or not enforceable."""
        if self.mid is None or self.tail is None or self.held_opening(name) is None:
            return None
        mid = self.mid[:-1]
        calls = [
            ("" if name is not None else t["function"]["name"] + mid, t["function"])
            for t in tools
            if name is None or t["function"]["name"] == name
        ]
        try:
            return grammar.forced_call(calls, self.tail)
        except grammar.GrammarError:
            return None


def model_tools(name: str, spec: str | None = None) -> ModelTools:
    """The tool calling of model `name` under the template the ranks settle on for
    --chat-template `spec`, from its tokenizer's files on this machine (none found:
    no tools)."""
    try:
        # deferred: exokv.model.loading imports mlx-lm and transformers (4 s); the first
        # request with tools pays it, not the server's start
        from exokv.model.loading import load_tokenizer

        tokenizer, config = load_tokenizer(model_files(name))  # as the ranks load it
        settled = templates.settle(tokenizer, config.get("model_type"), spec)
    except Exception:  # noqa: BLE001 - a front end without the files serves no tools
        return ModelTools(template=False)
    template = settled.text
    if template is None and isinstance(tokenizer.chat_template, str):
        template = tokenizer.chat_template
    start = tokenizer.tool_call_start
    head, mid, after = None, None, None
    if has_tools_support(template) and start:
        head, mid, after = _call_text(tokenizer, start, settled.text)
    end = tokenizer.tool_call_end
    at = after.find(end) if after is not None and end else -1
    return ModelTools(
        template=has_tools_support(template),
        start=start,
        end=tokenizer.tool_call_end,
        parser=tokenizer.tool_parser,
        head=head,
        mid=mid,
        tail=after[: at + len(end)] if after is not None and at >= 0 else None,
    )


# Two names and two argument sets no template writes alike: where their renders part
# is where the name (or the arguments) begin.
_NAMES = ("alpha_exokv_probe", "omega_exokv_probe")
_ARGUMENTS = ({}, {"exokv_probe": "x"})


def _call_text(
    tokenizer: Any, start: str, template: str | None
) -> tuple[str | None, str | None, str | None]:
    """How the template writes an assistant's call, read from its own renders: the
    text after the generation prompt up to the function's name (`head`, which holds
    the start marker), from the name up to where the arguments differ (`mid`), and
    what follows empty arguments written `{}` (None: not written so)."""
    user = [{"role": "user", "content": "x"}]
    tools = [
        {
            "type": "function",
            "function": {
                "name": n,
                "description": "",
                "parameters": {"type": "object", "properties": {"exokv_probe": {"type": "string"}}},
            },
        }
        for n in _NAMES
    ]

    def render(messages: list[dict[str, Any]], generation: bool) -> str:
        kw = {} if template is None else {"chat_template": template}
        return tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=generation, tokenize=False, **kw
        )

    def call(name: str, arguments: dict[str, Any]) -> str | None:
        function = {"name": name, "arguments": arguments}
        message = {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "c", "type": "function", "function": function}],
        }
        text = render([*user, message], False)
        return text[len(asked) :] if text.startswith(asked) else None

    try:
        asked = render(user, True)
        calls = [call(_NAMES[0], _ARGUMENTS[0]), call(_NAMES[1], _ARGUMENTS[0])]
        other = call(_NAMES[0], _ARGUMENTS[1])
    except Exception:  # noqa: BLE001 - a template that cannot render a call: none forced
        return None, None, None
    if calls[0] is None or calls[1] is None or other is None:
        return None, None, None
    head = os.path.commonprefix([calls[0], calls[1]])
    if start not in head or not all(c.startswith(head + _NAMES[0]) for c in (calls[0], other)):
        return None, None, None
    after = len(head) + len(_NAMES[0])
    mid = os.path.commonprefix([calls[0][after:], other[after:]])
    if "exokv_probe" in mid:
        return None, None, None
    rest = calls[0][after + len(mid) - 1 :]
    empty = mid.endswith("{") and rest.startswith("{}")
    return head, mid, rest[2:] if empty else None


def model_files(name: str) -> Path:
    """The directory of model `name`'s files on this machine, as its ranks resolve it."""
    repo = hub.parse_name(name) if not Path(name).expanduser().exists() else None
    if repo is not None:  # a repo: only what is here already (the ranks loaded it)
        snapshot = hub.cached_snapshot(*repo)
        if snapshot is None:
            raise FileNotFoundError(name)
        return Path(snapshot)
    return resolve_model(name)


def check(tools: ModelTools | None, model: str, asked: bool) -> None:
    """A request with tools (or tool messages) for a model whose template has none: 400."""
    if asked and (tools is None or not tools.template):
        raise ApiError(
            400,
            f"the model {model!r} has no tools support: its chat template does not read "
            "`tools`; send the request without tools, or serve a model whose template has them",
            param="tools",
            code="tools_not_supported",
        )


def forced_opening(tools: ModelTools | None, model: str, call: Any) -> str:
    """The opening a forced call's reply starts with; 400 for a model whose template
    does not show how it writes a call (then only the model may decide)."""
    opening = tools.opening(call.forced_name) if tools is not None else None
    if opening is None:
        raise ApiError(
            400,
            f"tool_choice: the model {model!r} cannot be made to call a tool: its chat "
            "template does not show how it writes a call that its tool parser reads; "
            "let the model decide (auto)",
            param="tool_choice",
            code="tool_choice_not_supported",
        )
    return opening


def openai_call(parsed: dict[str, Any]) -> dict[str, Any]:
    arguments = parsed.get("arguments", {})
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {
        "id": f"call_{secrets.token_hex(12)}",
        "type": "function",
        "function": {"name": str(parsed.get("name", "")), "arguments": arguments},
    }


class ToolText:
    """A reply's text, cut into what it says and the tool calls it makes, as it streams.

    Text that could be the start of a call's marker is held back until the next piece
    says whether it is; a call is parsed once its end marker has come (or the reply
    ended). A call the parser cannot read stays in the text, as the model wrote it.
    """

    def __init__(self, tools: ModelTools, declared: list[dict[str, Any]]) -> None:
        self.tools = tools
        self.declared = declared
        self.pending = ""
        self.inside = False
        self.calls: list[dict[str, Any]] = []

    def feed(self, piece: str) -> tuple[str, list[dict[str, Any]]]:
        start, end = self.tools.start, self.tools.end
        if not start or not end or self.tools.parser is None:
            return piece, []
        self.pending += piece
        out, new = "", []
        while True:
            if not self.inside:
                at = self.pending.find(start)
                if at < 0:
                    keep = _partial_suffix(self.pending, start)
                    out += self.pending[: len(self.pending) - keep]
                    self.pending = self.pending[len(self.pending) - keep :]
                    return out, new
                out += self.pending[:at]
                self.pending = self.pending[at + len(start) :]
                self.inside = True
            at = self.pending.find(end)
            if at < 0:
                return out, new
            body, self.pending = self.pending[:at], self.pending[at + len(end) :]
            self.inside = False
            calls = self._parse(body)
            if calls is None:
                out += start + body + end
            else:
                new += calls

    def flush(self) -> tuple[str, list[dict[str, Any]]]:
        """The reply ended: a call left open is parsed as it is, the rest is text."""
        pending, self.pending = self.pending, ""
        if not self.inside:
            return pending, []
        self.inside = False
        calls = self._parse(pending)
        return (self.tools.start or "") + pending if calls is None else "", calls or []

    def _parse(self, body: str) -> list[dict[str, Any]] | None:
        assert self.tools.parser is not None
        try:
            parsed = self.tools.parser(body, self.declared)
        except Exception:  # noqa: BLE001 - not a call the parser reads: it stays text
            return None
        items = parsed if isinstance(parsed, list) else [parsed]
        if not items or not all(isinstance(p, dict) and p.get("name") for p in items):
            return None
        calls = [openai_call(p) for p in items]
        self.calls += calls
        return calls


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
