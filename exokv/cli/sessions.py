"""`exokv sessions list|show|rm|rename`: the stored conversations, as `llm logs` shows them."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import typer
from rich.console import Console
from rich.text import Text

from exokv.config import exokv_home
from exokv.core import tables
from exokv.errors import ExokvError
from exokv.state import Store
from exokv.state.locks import SessionBusy, SessionLocks

sessions_app = typer.Typer(
    help="The stored conversations: list, show, rm, rename.", no_args_is_help=True
)

JSON_HELP = "Print JSON instead of text."


def _console() -> Console:
    wide = not sys.stdout.isatty() and "COLUMNS" not in os.environ
    return Console(highlight=False, width=160 if wide else None)


def _emit(doc: Any) -> None:
    print(json.dumps(doc, indent=2))


def _store() -> Store | None:
    return Store.open_existing(exokv_home())


def _store_of(name: str) -> Store:
    """The store, for a command on session `name`; no store at all means no such session."""
    store = _store()
    if store is None:
        raise _no_session(name)
    return store


def _no_session(name: str) -> ExokvError:
    return ExokvError(f"no session {name!r}: `exokv sessions list` shows them")


def _not_in_use(name: str) -> SessionLocks:
    """Hold the session's lock (exokv.state.locks), so no chat has it open while it is
    changed: a chat writes its conversation back. Held until this process ends."""
    locks = SessionLocks(exokv_home())
    try:
        locks.acquire(name)
    except SessionBusy as err:
        raise ExokvError(str(err).split(";")[0] + ": quit that chat first") from None
    return locks


@sessions_app.command("list")
def list_sessions(
    limit: int = typer.Option(0, "--limit", "-l", help="At most this many, newest first."),
    as_json: bool = typer.Option(False, "--json", help=JSON_HELP),
) -> None:
    """Every conversation, most recently used first: turns, tokens, model, last used."""
    store = _store()
    rows = [] if store is None else store.sessions()
    if store is not None:
        store.close()
    for row in rows:
        row["turns"] = row["messages"] // 2 if row["messages"] else row["turns"]
    if limit > 0:
        rows = rows[:limit]
    if as_json:
        _emit({"sessions": rows})
        return
    console = _console()
    if not rows:
        console.print("No sessions yet: start one with `exokv chat`.")
        return
    console.print(tables.sessions_table(rows, console.width))


@sessions_app.command()
def show(
    name: str = typer.Argument(..., metavar="NAME", help="the session"),
    as_json: bool = typer.Option(False, "--json", help=JSON_HELP),
) -> None:
    """The conversation's transcript, with its model and system prompt."""
    store = _store_of(name)
    with store:
        info = store.session_info(name)
        if info is None:
            raise _no_session(name)
        messages = store.load_messages(name)
    if as_json:
        _emit({**info, "transcript": messages})
        return
    console = _console()
    head = f"# {name} · {info['model'] or '?'} · {tables.when(info['last_used'])}"
    console.print(Text(head, style="bold"))
    if info.get("system"):
        console.print(Text(f"system: {info['system']}", style="dim"))
    for m in messages:
        console.print()
        console.print(Text(f"{m['role']}:", style="bold cyan" if m["role"] == "user" else "bold"))
        console.print(Text(m["content"]), soft_wrap=True)


@sessions_app.command()
def rm(
    name: str = typer.Argument(..., metavar="NAME", help="the session"),
    as_json: bool = typer.Option(False, "--json", help=JSON_HELP),
) -> None:
    """Delete a conversation and its turns (its KV on disk ages out; `exokv cache clear`)."""
    store = _store_of(name)
    _not_in_use(name)
    with store:
        count = store.delete_session(name)
    if as_json:
        _emit({"removed": name, "messages": count})
        return
    _console().print(f"removed {name!r}: {count} messages")


@sessions_app.command()
def rename(
    old: str = typer.Argument(..., metavar="OLD", help="the session"),
    new: str = typer.Argument(..., metavar="NEW", help="its new name"),
    as_json: bool = typer.Option(False, "--json", help=JSON_HELP),
) -> None:
    """Rename a conversation (its KV cache is keyed by its tokens: it follows)."""
    if not new.strip() or new != new.strip():
        raise ExokvError(f"invalid name {new!r}: no spaces around it, and not empty")
    store = _store_of(old)
    _not_in_use(old)
    with store:
        store.rename_session(old, new)
    if as_json:
        _emit({"renamed": old, "to": new})
        return
    _console().print(f"renamed {old!r} to {new!r}")
