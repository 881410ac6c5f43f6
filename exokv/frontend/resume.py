"""What `exokv chat --session NAME` takes from a stored session before anything starts.

A session remembers its model, system prompt, --max-kv-size and --chat-template.
Resuming it without those flags uses them; naming another model is allowed and said
in one line (its saved KV cache belongs to the other model, so the first turn
prefills the whole history). An ``ollama:`` model brings what ``ollama run`` would
use besides its weights (exokv.model.ollama.run_defaults).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from exokv.config import default_model
from exokv.model.ollama import run_defaults
from exokv.model.templates import Format, read_choice
from exokv.state import Store


@dataclass
class Resolved:
    model: str
    max_kv_size: int | None
    notes: list[str] = field(default_factory=list)
    chat_template: str | None = None  # a spec: the flag's, else the session's (what it keeps)
    defaults: Format = field(default_factory=Format)  # the model's own (an ollama manifest's)
    stored_system: bool = False  # the resumed session has a system prompt of its own

    @property
    def prompt_format(self) -> Format:
        """What the ranks render with: the chosen template, else the model's default."""
        d = self.defaults
        return Format(self.chat_template or d.template, d.stops, d.context)


def stored_session(name: str) -> dict | None:
    """The stored session's row (model, system, max_kv_size, ...), or None; creates nothing."""
    store = Store.open_existing()
    if store is None:
        return None
    with store:
        return store.session_info(name)


def resolve(
    session: str | None,
    model: str | None,
    max_kv_size: int | None,
    chat_template: str | None = None,
) -> Resolved:
    """The model, --max-kv-size and --chat-template to run with, and what to tell the user."""
    template = read_choice(chat_template) if chat_template is not None else None
    stored = stored_session(session) if session else None
    was = (stored or {}).get("model") or None
    if model is None and was:
        model = was
        notes = [f"resuming {session!r} on {was}"]
    elif model is None:
        model = default_model()
        notes = [
            f"using {model} (choose another with --model or EXOKV_MODEL; `exokv models` lists them)"
        ]
    elif was and was != model:
        notes = [
            f"session {session!r} was on {was}; it continues on {model} as asked "
            "(its saved KV cache is for the other model: the first turn prefills it all)"
        ]
    else:
        notes = []
    if max_kv_size is None and stored and stored.get("max_kv_size"):
        max_kv_size = int(stored["max_kv_size"])
    if template is None and stored and stored.get("chat_template"):
        template = stored["chat_template"]
    defaults = Format()
    if model.strip().startswith("ollama:"):
        defaults = run_defaults(model.strip()[len("ollama:") :])
        if template is None:
            notes += defaults.notes
    has_system = bool(stored and stored.get("system"))
    return Resolved(model, max_kv_size, notes, template, defaults, has_system)
