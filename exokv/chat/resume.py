"""What `exokv chat --session NAME` takes from a stored session before anything starts.

A session remembers its model, system prompt and --max-kv-size. Resuming it without
those flags uses them; naming another model is allowed and said in one line (its saved
KV cache belongs to the other model, so the first turn prefills the whole history).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from exokv.config import default_model


@dataclass
class Resolved:
    model: str
    max_kv_size: int | None
    notes: list[str] = field(default_factory=list)


def stored_session(name: str) -> dict | None:
    """The stored session's row (model, system, max_kv_size, ...), or None; creates nothing."""
    from exokv.state import Store

    store = Store.open_existing()
    if store is None:
        return None
    with store:
        return store.session_info(name)


def resolve(session: str | None, model: str | None, max_kv_size: int | None) -> Resolved:
    """The model and --max-kv-size to run with, and what to tell the user about them."""
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
    return Resolved(model, max_kv_size, notes)
