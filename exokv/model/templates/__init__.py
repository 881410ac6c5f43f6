"""Chat templates: the built-ins, a ``--chat-template`` value, and what a rank renders with.

The built-ins are Jinja files beside this module (package data). A choice travels as
a *spec*: a built-in's name, or the Jinja text of a file (read once, at the front end,
so ranks on other hosts need no copy of it and a stored session keeps the text).

Every rank settles the same template from the same spec and tokenizer files
(`settle`), so every rank renders the same tokens. A model with no template of its
own gets one from its architecture or its vocabulary, as llama.cpp picks one, and a
base model (no chat tokens at all) a plain "User:/Assistant:" format: the line that
says which is the caller's to print (rank 0's).
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from exokv.errors import ExokvError, UsageError, one_line

HERE = Path(__file__).parent
PLAIN = "plain"


@dataclass(frozen=True)
class Builtin:
    ends: tuple[str, ...] = ()  # end-of-turn tokens: generation stops on each the vocabulary has
    stops: tuple[str, ...] = ()  # text that ends a reply (a base model's next turn)
    writes_bos: bool = False  # the text starts with bos_token itself


BUILTINS: dict[str, Builtin] = {
    "chatml": Builtin(ends=("<|im_end|>",)),
    "qwen": Builtin(ends=("<|im_end|>", "<|endoftext|>")),
    "llama3": Builtin(ends=("<|eot_id|>", "<|eom_id|>"), writes_bos=True),
    "gemma": Builtin(ends=("<end_of_turn>",), writes_bos=True),
    "mistral": Builtin(ends=("</s>",), writes_bos=True),
    "phi": Builtin(ends=("<|end|>", "<|endoftext|>")),
    PLAIN: Builtin(stops=("\nUser:",)),
}
NAMES = tuple(BUILTINS)

# Marker -> built-in, first match wins: for a vocabulary (a model without a template)
# and for an ollama template layer (a Go template) alike.
MARKERS: tuple[tuple[str, str], ...] = (
    ("<|im_start|>", "chatml"),
    ("<|start_header_id|>", "llama3"),
    ("<start_of_turn>", "gemma"),
    ("[INST]", "mistral"),
    ("<|user|>", "phi"),
)


@cache
def builtin_text(name: str) -> str:
    """The Jinja text of built-in ``name``."""
    return (HERE / f"{name}.jinja").read_text(encoding="utf-8")


def by_markers(text: str) -> str | None:
    """The built-in whose markers ``text`` holds (a template or a list of tokens), if any."""
    return next((name for marker, name in MARKERS if marker in text), None)


# -- the front end: a --chat-template value ---------------------------------------


def read_choice(value: str) -> str:
    """``--chat-template NAME|FILE`` -> a spec (a built-in's name, or the file's Jinja text);
    a usage error in one line for anything else."""
    value = value.strip()
    if value in BUILTINS:
        return value
    path = Path(value).expanduser()
    names = ", ".join(NAMES)
    if not value or not path.exists():
        raise UsageError(
            f"--chat-template {value!r}: not a built-in template ({names}) nor a Jinja file"
        )
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"--chat-template {value}: cannot be read ({one_line(e)})") from None
    check_jinja(text, f"--chat-template {value}")
    return text


def check_jinja(text: str, what: str) -> None:
    """A usage error unless ``text`` parses as Jinja (what transformers renders with)."""
    import jinja2  # deferred: jinja2 (~40 ms) only for --chat-template; every chat imports this

    if not text.strip():
        raise UsageError(f"{what}: the template is empty")
    try:
        jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise UsageError(f"{what}: not a Jinja template (line {e.lineno}: {e.message})") from None


def is_builtin(spec: str | None) -> bool:
    return spec in BUILTINS


def label(spec: str | None) -> str:
    """How a spec is named in a line: the built-in's name, or 'a template file'."""
    if spec is None:
        return "the model's own"
    return spec if is_builtin(spec) else "a template file"


# -- the ranks' command line: the prompt format as one opaque argument --------------


@dataclass(frozen=True)
class Format:
    """What the front end decided about the prompt, for every rank alike."""

    template: str | None = None  # a spec; None: the model's own, or a fallback
    stops: tuple[str, ...] = ()  # stop sequences besides the template's (ollama's params)
    context: int | None = None  # a context limit below the model's (ollama's num_ctx)
    system: str | None = None  # the default system prompt (ollama's; the front end uses it)
    temperature: float | None = None  # the default temperature (ollama's params)
    notes: list[str] = field(default_factory=list, compare=False)

    def to_arg(self) -> str:
        """One command-line word (base64 JSON: no quoting over ssh)."""
        doc = {"template": self.template, "stops": list(self.stops), "context": self.context}
        return base64.urlsafe_b64encode(json.dumps(doc).encode()).decode()

    @classmethod
    def from_arg(cls, arg: str | None) -> Format:
        if not arg:
            return cls()
        doc = json.loads(base64.urlsafe_b64decode(arg.encode()))
        return cls(doc.get("template"), tuple(doc.get("stops") or ()), doc.get("context"))


# -- a rank: the template it renders with ------------------------------------------


@dataclass(frozen=True)
class Settled:
    """The template a rank renders with and how a reply ends."""

    name: str  # a built-in's name, "file" or "model" (the tokenizer's own)
    text: str | None  # the Jinja text; None: the tokenizer's own
    ends: tuple[int, ...] = ()  # end-of-turn token ids besides the tokenizer's EOS
    stops: tuple[str, ...] = ()
    note: str = ""  # the one line to say (a fallback), "" for none


def settle(tokenizer: Any, model_type: str | None, spec: str | None) -> Settled:
    """The template for ``spec`` (None: the model's own, else a fallback); the same on
    every rank for the same spec and tokenizer files."""
    vocab = _vocab(tokenizer)
    if spec is not None and not is_builtin(spec):
        settled = Settled("file", spec)
    elif spec is not None:
        settled = _builtin(spec, tokenizer, vocab)
    elif getattr(tokenizer, "chat_template", None):
        return Settled("model", None)
    else:
        name, why = fallback(model_type, vocab)
        settled = _builtin(name, tokenizer, vocab)
        if name == PLAIN:
            note = (
                "model has no chat template and no chat tokens (a base model); using a plain "
                "'User: ... Assistant:' format (choose one with --chat-template)"
            )
        else:
            note = f"model has no chat template; using {name} ({why}; --chat-template chooses)"
        settled = Settled(settled.name, settled.text, settled.ends, settled.stops, note)
    _check_renders(tokenizer, settled)
    return settled


def fallback(model_type: str | None, vocab: dict[str, int]) -> tuple[str, str]:
    """The built-in for a model without a template, and why (for the one line)."""
    family = (model_type or "").lower()
    if family.startswith("gemma") and "<start_of_turn>" in vocab:
        return "gemma", f"from its architecture, {model_type}"
    for marker, name in MARKERS:
        if marker in vocab:
            return name, f"its vocabulary has {marker}"
    return PLAIN, "a base model"


def _builtin(name: str, tokenizer: Any, vocab: dict[str, int]) -> Settled:
    spec = BUILTINS[name]
    text = builtin_text(name)
    if not spec.writes_bos and adds_bos(tokenizer):
        # The renderer encodes without special tokens: BOS must be in the text, as the
        # tokenizer would have put it first (a sentencepiece base model needs it).
        text = "{{- bos_token -}}\n" + text
    ends = tuple(vocab[t] for t in spec.ends if t in vocab)
    return Settled(name, text, ends, spec.stops)


def adds_bos(tokenizer: Any) -> bool:
    """Whether encoding adds a BOS token (the file's add_bos_token, as the tokenizer has it)."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return False
    try:
        ids = list(tokenizer.encode("a"))
        plain = list(tokenizer.encode("a", add_special_tokens=False))
    except Exception:  # noqa: BLE001 - a tokenizer that cannot say adds nothing here
        return False
    return bool(ids) and ids[0] == bos and (not plain or plain[0] != bos)


def _vocab(tokenizer: Any) -> dict[str, int]:
    try:
        return dict(tokenizer.get_vocab())
    except Exception:  # noqa: BLE001 - a tokenizer without a vocabulary to read
        return {}


def _check_renders(tokenizer: Any, settled: Settled) -> None:
    """A template that cannot render a short conversation fails here, in one line, before
    any turn (the same on every rank)."""
    sample = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": "a"},
        {"role": "user", "content": "u"},
    ]
    error: Exception | None = None
    for conversation in (sample, sample[1:]):  # some templates refuse a system message
        try:
            tokenizer.apply_chat_template(
                conversation, add_generation_prompt=True, tokenize=False, chat_template=settled.text
            )
            return
        except Exception as e:  # noqa: BLE001 - Jinja's errors are many; each is one line here
            error = error or e
    raise ExokvError(
        f"the chat template ({settled.name}) cannot render a conversation: {one_line(error)}"
    ) from None
