"""StoreHooks: the chat controller's conversations, kept in the SQLite store.

Every finished turn is one `Store.record_turn` transaction (the messages after the
turn with the replies' exact token ids, the turn's numbers, its cache events, entries
and memory samples), so a crash loses at most the turn in progress. Sessions are
loaded from the store when opened, each reply's message with its tokens, which every
later request carries to the ranks (exokv.prompt.render). KV is kept on disk by the
disk tier alone (`exokv.rank.kvsave`): `/save` and quitting write the current
session's cached path to every rank's tier, and a resumed session's next turn loads
what the restored tree holds of it.

Messages for the user go through `attach(warn, note)`: until a front end attaches,
they are buffered, so a warning raised while the first session is opened is shown
after the banner, not before it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from exokv.chat.conversation import ChatController, ChatHooks, Conversation, plural
from exokv.client import Client
from exokv.core.records import CacheEvent, CacheFileReport, RankStats, TurnResult
from exokv.core.sizes import format_size
from exokv.prompt.render import with_reply_tokens
from exokv.state import queries
from exokv.state.locks import SessionLocks
from exokv.state.store import Store

_UNSET = object()


def stderr_warning(text: str) -> None:
    print(f"exokv: warning: {text}", file=sys.stderr, flush=True)


class StoreHooks(ChatHooks):
    def __init__(
        self,
        store: Store,
        run_id: int,
        model: str,
        client: Client | None = None,
        use_cache: bool = True,
        max_kv_size: int | None = None,
        locks: SessionLocks | None = None,
        chat_template: str | None = None,
    ) -> None:
        super().__init__()  # pins of sessions not stored yet wait there for their first turn
        self.store = store
        self.max_kv_size = max_kv_size
        self.chat_template = chat_template  # a spec (exokv.model.templates), kept by sessions
        self._options_written: set[str] = set()  # sessions whose settings are stored
        self.locks = locks  # one chat per session (exokv.state.locks)
        self.run_id = run_id
        self.model = model
        self.client = client
        self.use_cache = use_cache
        self._system: dict[str, Any] = {}  # the system prompt last written per session
        self._dirty: set[str] = set()  # sessions changed since their cache was saved
        self._buffer: list[tuple[str, str]] = []
        self._warn: Callable[[str], None] | None = None
        self._note: Callable[[str], None] | None = None
        # session -> the context (prompt + reply tokens) after each exchange of this run,
        # so /sessions is right after /undo; None where not known (before a resume)
        self._context: dict[str, list[int | None]] = {}
        self._hosts: list[str] = []  # the run's hosts as last stored (after a re-plan)

    # -- where messages for the user go ------------------------------------------------

    def attach(
        self, warn: Callable[[str], None] | None = None, note: Callable[[str], None] | None = None
    ) -> None:
        self._warn = warn or stderr_warning
        self._note = note or (lambda _text: None)
        pending, self._buffer = self._buffer, []
        for kind, text in pending:
            (self._warn if kind == "warn" else self._note)(text)

    def warn(self, text: str) -> None:
        if self._warn is None:
            self._buffer.append(("warn", text))
        else:
            self._warn(text)

    def note(self, text: str) -> None:
        if self._note is None:
            self._buffer.append(("note", text))
        else:
            self._note(text)

    # -- conversations -------------------------------------------------------------------

    def load(self, name: str) -> Conversation | None:
        if self.locks is not None:
            self.locks.acquire(name)  # before reading it: no other chat is adding turns
        if name not in self.store.session_names():
            return None
        system = self.store.get_system(name) or None
        # Each reply with the exact tokens generated for it, as the next turn renders it.
        messages = self.store.load_messages(name, with_tokens=True)
        self._system[name] = system
        return Conversation(name=name, system=system, messages=messages)

    def opened(self, conv: Conversation, announce: bool = True) -> str | None:
        if conv.name not in self._system:
            return None  # new: written with its first turn (an empty session leaves no row)
        self._options_written.add(conv.name)  # an existing session keeps its settings
        info = self.store.session_info(conv.name) or {}
        self.store.ensure_session(conv.name, "")  # marks it used, keeps its model
        if not conv.messages:
            return None
        if announce:
            self.note(f"resumed {conv.name!r}: {plural(conv.turns, 'turn')}")
        was = info.get("model") or ""
        if was and was != self.model:
            # Its KV cache belongs to the other model's disk tier: nothing to find.
            return None if announce else f"it was on {was}, continues on {self.model}"
        found = self._cached(conv)
        if announce:
            if found:
                self.note(f"its KV cache: {found}")
            return None
        return f"KV cache: {found}" if found else None

    def _cached(self, conv: Conversation) -> str | None:
        """How much of a resumed session the cache holds (the disk tier kept it), in words."""
        if not self.use_cache or self.client is None:
            return None
        report = self.client.cache_held(conv.name, conv.prompt())
        if not report.tokens:
            return None
        if report.on_disk:
            return f"{report.tokens:,} tokens on disk, loaded by the next turn"
        return f"{report.tokens:,} tokens cached, prefilled no more"

    def stored_sessions(self) -> list[str]:
        return self.store.session_names()

    def pins(self) -> set[str]:
        return set(self.store.pinned_sessions()) | self._pins

    def set_pinned(self, name: str, pinned: bool) -> None:
        # A session with no turn has no row yet: its pin is written with its first turn.
        if self.store.set_pinned(name, pinned):
            self._pins.discard(name)
        else:
            super().set_pinned(name, pinned)

    def _sync_system(self, conv: Conversation) -> None:
        if self._system.get(conv.name, _UNSET) != conv.system:
            self.store.ensure_session(conv.name, self.model, conv.system or "")
            self._system[conv.name] = conv.system

    def save_messages(self, conv: Conversation) -> None:
        if conv.name not in self._system and conv.name not in self._options_written:
            return  # not stored yet: its first turn writes it, system prompt included
        self._sync_system(conv)
        # A reply without tokens keeps those stored for it (Store.set_messages).
        self.store.set_messages(conv.name, conv.messages)
        self._dirty.add(conv.name)

    def turn_done(self, conv: Conversation, result: TurnResult) -> None:
        _carry_reply_tokens(conv, result)
        context = self._context.setdefault(conv.name, [])
        del context[max(conv.turns - 1, 0) :]  # a /retry replaces the last exchange's
        context.extend([None] * (max(conv.turns - 1, 0) - len(context)))
        context.append(result.prompt_tokens + result.generated_tokens)
        self._sync_system(conv)
        self.store.record_turn(self.run_id, conv.name, conv.messages, result, self.model)
        self._note_hosts()
        if conv.name not in self._options_written:
            # The session's first turn created it: it remembers this run's settings.
            self.store.set_session_options(conv.name, self.max_kv_size, self.chat_template)
            self._options_written.add(conv.name)
        if conv.name in self._pins:
            self.set_pinned(conv.name, True)
        self._dirty.add(conv.name)

    def _note_hosts(self) -> None:
        """The run's hosts as they are now: a re-plan (a host gone, /hosts) changes them,
        and a session resumed later asks them for its KV files."""
        if self.client is None:
            return
        hosts = [h.host for h in self.client.hosts() if h.state == "up"]
        if hosts and hosts != self._hosts:
            self.store.set_run_hosts(self.run_id, hosts)
            self._hosts = hosts

    def forget(self, name: str) -> None:
        """Drop what is kept in memory about a session; its stored rows stay. A server
        sees each API conversation once per call and would otherwise keep them all."""
        self._system.pop(name, None)
        self._dirty.discard(name)
        self._context.pop(name, None)
        self._options_written.discard(name)

    # -- the tables of /sessions, /stats, /evictions ---------------------------------------

    def list_sessions(self, chat: ChatController) -> list[dict[str, Any]]:
        # turns: exchanges in the conversation now (the store's count also has the
        # replies that /retry replaced and /undo dropped); tokens: at its last turn.
        rows = [
            {
                "name": r["name"],
                "turns": r["messages"] // 2,
                "tokens": r["tokens"],
                "cached_tokens": r["cached_tokens"],
                "model": r["model"],
                "last_used": r["last_used"],
                "pinned": r.get("pinned", False),
            }
            for r in self.store.sessions()
        ]
        stored = {r["name"] for r in rows}
        for row in rows:
            if row["name"] in chat.sessions:
                row["turns"] = chat.sessions[row["name"]].turns
                row["tokens"] = self._tokens_now(row["name"], row["turns"], row["tokens"])
        for conv in chat.sessions.values():
            if conv.name not in stored:  # opened in this run, no turn yet
                row = {"name": conv.name, "turns": conv.turns, "tokens": 0, "cached_tokens": 0}
                row["pinned"] = conv.name in self._pins
                row["model"] = self.model
                rows.insert(0, {**row, "last_used": None})
        for row in rows:
            row["current"] = row["name"] == chat.current.name
        return rows

    def _tokens_now(self, name: str, turns: int, stored: int) -> int:
        """The context of a session's conversation now: after /undo, that of the exchange
        now last, not the store's (its last turn, which /undo dropped)."""
        if not turns:
            return 0
        context = self._context.get(name, [])
        known = context[turns - 1] if turns <= len(context) else None
        return stored if known is None else known

    def stats(self, chat: ChatController) -> list[dict[str, Any]]:
        rows = [r for r in self.store.stats()["ranks"] if r["run"] == self.run_id]
        return rows or super().stats(chat)

    def evictions(self, chat: ChatController) -> list[dict[str, Any]]:
        return self.store.evictions(limit=10)

    # -- saving the KV cache ---------------------------------------------------------------

    def save(self, conv: Conversation) -> CacheFileReport | None:
        """Save `conv`'s KV cache on every rank; None without a cache (or a client)."""
        if self.client is None or not self.use_cache:
            return None
        try:
            report = self.client.save_cache(conv.name, conv.prompt())
        except OSError as err:
            report = CacheFileReport(session=conv.name, warning=f"could not write it: {err}")
        if report.events:
            self.store.record_events(self.run_id, [CacheEvent.from_dict(e) for e in report.events])
        if report.disk_bytes:
            self._sample_disk(report.disk_bytes)
        if report.tokens and not report.warning:
            self._dirty.discard(conv.name)
        return report

    def _sample_disk(self, disk: list[int]) -> None:
        """The disk tier grew by /save's copies: a memory sample that says so, or /stats
        would show the disk as of the last turn (0 B before the first write-through)."""
        with self.store.snapshot() as db:
            latest = queries.latest_samples(db, self.run_id)
        stats = [
            RankStats.from_dict({**row, "disk_bytes": disk[row["rank"]]})
            for row in latest
            if row["rank"] < len(disk)
        ]
        if stats:
            self.store.record_samples(self.run_id, stats)

    def save_cache(self, chat: ChatController) -> str:
        conv = chat.current
        if not self.use_cache:
            return "nothing to save: with --no-cache there is no KV cache"
        if not conv.messages:
            return f"nothing to save: {conv.name!r} has no messages yet"
        report = self.save(conv)
        if report is None:
            return "saving KV caches is not available with this client"
        self.save_failed = bool(report.warning)  # --json: "ok": false
        return describe_save(conv.name, report)

    def finish(self, chat: ChatController) -> None:
        """On quit: save the current session's KV cache if it changed since it was saved."""
        conv = chat.current
        if not conv.messages or conv.name not in self._dirty:
            return
        report = self.save(conv)
        if report is None:
            return
        if report.warning:
            self.warn(describe_save(conv.name, report))
        elif report.tokens:
            self.note(describe_save(conv.name, report))


def _carry_reply_tokens(conv: Conversation, result: TurnResult) -> None:
    """The turn's reply, the conversation's last message, with its exact tokens: the
    chat's has them already; a server's conversation is rebuilt from the request."""
    last = conv.messages[-1] if conv.messages else None
    if last is not None and last["role"] == "assistant" and last["content"] == result.reply:
        if "tokens" not in last:
            conv.messages[-1] = with_reply_tokens(last, result.reply_tokens)


def describe_save(session: str, report: CacheFileReport) -> str:
    if report.warning:
        return f"KV cache of {session!r} not saved: {report.warning}"
    if not report.tokens:
        return f"KV cache of {session!r} not saved: {report.skipped or 'nothing cached'}"
    where = report.paths[0] if len(report.paths) == 1 else f"{len(report.paths)} ranks' tiers"
    size = format_size(sum(report.bytes))
    return (
        f"saved the KV cache of {session!r}: {report.tokens:,} tokens, {size}, "
        f"{report.seconds:.2f} s ({where})"
    )
