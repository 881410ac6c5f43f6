"""Conversations and the slash commands that edit them: no I/O, no MLX.

Both the REPL and script mode feed lines to `ChatController.handle`; it returns
what happened (a turn or a command's message) and the front end renders it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from exokv.records import TurnRequest, TurnResult

COMMANDS = {
    "/help": "list the commands",
    "/new": "/new [NAME]  start a new conversation",
    "/switch": "/switch NAME  go back to another conversation",
    "/sessions": "list the conversations",
    "/retry": "regenerate the last reply",
    "/undo": "drop the last exchange",
    "/system": "/system TEXT  set the system prompt of this conversation",
    "/stats": "the cache on each rank",
    "/evictions": "the latest evictions",
    "/save": "save this conversation's KV cache",
    "/quit": "leave (the conversation is kept)",
}


class Client(Protocol):
    """Runs turns on one rank or on a cluster."""

    def turn(
        self,
        request: TurnRequest,
        on_text: Callable[[str], None] | None = None,
        on_progress: Callable[[int, int], None] | None = None,
    ) -> TurnResult: ...


@dataclass
class Conversation:
    name: str
    system: str | None = None
    messages: list[dict[str, str]] = field(default_factory=list)

    def prompt(self) -> list[dict[str, str]]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.messages

    @property
    def turns(self) -> int:
        return sum(1 for m in self.messages if m["role"] == "assistant")


@dataclass
class Outcome:
    """What one input line did: a turn, a message, or both (quit)."""

    command: str | None = None
    message: str = ""
    data: Any = None
    result: TurnResult | None = None
    turn: int = 0
    quit: bool = False
    error: bool = False


@dataclass
class TurnSettings:
    max_tokens: int = 256
    temp: float = 0.0
    seed: int | None = None
    use_cache: bool = True


class ChatController:
    """Holds the open conversations and turns input lines into turns or commands."""

    def __init__(
        self,
        client: Client,
        settings: TurnSettings,
        session: str | None = None,
        system: str | None = None,
        hooks: ChatHooks | None = None,
    ) -> None:
        self.client = client
        self.settings = settings
        self.hooks = hooks or ChatHooks()
        self.sessions: dict[str, Conversation] = {}
        self.current = self._open(session or _fresh_name(), system)
        self.last_result: TurnResult | None = None

    # -- input ------------------------------------------------------------------

    def handle(
        self,
        line: str,
        on_text: Callable[[str], None] | None = None,
        on_progress: Callable[[int, int], None] | None = None,
    ) -> Outcome | None:
        text = line.strip()
        if not text:
            return None
        if text.startswith("/"):
            return self.command(text, on_text, on_progress)
        self.current.messages.append({"role": "user", "content": line.rstrip("\n")})
        return self._run(on_text, on_progress)

    def command(
        self,
        text: str,
        on_text: Callable[[str], None] | None = None,
        on_progress: Callable[[int, int], None] | None = None,
    ) -> Outcome:
        name, _, arg = text.partition(" ")
        arg = arg.strip()
        conv = self.current
        if name == "/help":
            return Outcome(name, "\n".join(f"{k:<11} {v}" for k, v in COMMANDS.items()))
        if name == "/quit":
            return Outcome(name, "bye", quit=True)
        if name == "/new":
            if arg and arg in self.known_sessions():
                return Outcome(name, f"session {arg!r} exists; /switch {arg}", error=True)
            self.current = self._open(arg or _fresh_name(), conv.system)
            return Outcome(name, f"new session {self.current.name!r}")
        if name == "/switch":
            if not arg:
                return Outcome(name, "usage: /switch NAME", error=True)
            if arg not in self.known_sessions():
                return Outcome(name, f"no session {arg!r}; /sessions lists them", error=True)
            self.current = self._open(arg, None)
            return Outcome(name, f"switched to {arg!r} ({self.current.turns} turns)")
        if name == "/sessions":
            rows = self.hooks.list_sessions(self)
            return Outcome(name, "", data=rows)
        if name == "/system":
            conv.system = arg or None
            self.hooks.save_messages(conv)
            return Outcome(name, "system prompt set" if arg else "system prompt cleared")
        if name == "/undo":
            if not conv.messages:
                return Outcome(name, "nothing to undo", error=True)
            while conv.messages and conv.messages[-1]["role"] == "assistant":
                conv.messages.pop()
            if conv.messages and conv.messages[-1]["role"] == "user":
                conv.messages.pop()
            self.hooks.save_messages(conv)
            return Outcome(name, f"dropped the last exchange ({conv.turns} turns left)")
        if name == "/retry":
            if not conv.messages or conv.messages[-1]["role"] != "assistant":
                return Outcome(name, "nothing to retry", error=True)
            previous = conv.messages.pop()
            return self._run(on_text, on_progress, command=name, previous=previous)
        if name == "/stats":
            return Outcome(name, "", data=self.hooks.stats(self))
        if name == "/evictions":
            return Outcome(name, "", data=self.hooks.evictions(self))
        if name == "/save":
            message = self.hooks.save_cache(self)
            return Outcome(name, message, error=self.hooks.save_failed)
        return Outcome(name, f"unknown command {name}; /help lists them", error=True)

    def known_sessions(self) -> set[str]:
        return set(self.sessions) | set(self.hooks.stored_sessions())

    # -- internals --------------------------------------------------------------

    def _run(
        self,
        on_text: Callable[[str], None] | None,
        on_progress: Callable[[int, int], None] | None,
        command: str | None = None,
        previous: dict[str, str] | None = None,
    ) -> Outcome:
        """Run a turn on the current conversation, which ends with the user's message.

        A turn that fails, or is stopped (Ctrl-C) before any reply text, leaves the
        conversation as it was: the user line is dropped, or /retry's reply restored.
        """
        conv = self.current
        request = TurnRequest(
            session=conv.name,
            messages=conv.prompt(),
            max_tokens=self.settings.max_tokens,
            temp=self.settings.temp,
            seed=self.settings.seed,
            use_cache=self.settings.use_cache,
        )
        try:
            result = self.client.turn(request, on_text=on_text, on_progress=on_progress)
        except BaseException:
            self._undo_attempt(conv, command, previous)
            raise
        if result.finish_reason == "interrupted" and not result.reply:
            self._undo_attempt(conv, command, previous)
            return Outcome(command, "stopped before the reply began; nothing kept")
        conv.messages.append({"role": "assistant", "content": result.reply})
        self.last_result = result
        self.hooks.turn_done(conv, result)
        return Outcome(command, result=result, turn=conv.turns)

    @staticmethod
    def _undo_attempt(
        conv: Conversation, command: str | None, previous: dict[str, str] | None
    ) -> None:
        # The user line stays only when a reply was produced; /retry gets its old reply back.
        if previous is not None:
            conv.messages.append(previous)
        elif conv.messages and conv.messages[-1]["role"] == "user" and command is None:
            conv.messages.pop()

    def _open(self, name: str, system: str | None) -> Conversation:
        if name not in self.sessions:
            stored = self.hooks.load(name)
            conv = stored or Conversation(name=name, system=system)
            if stored is None or (system and not stored.messages):
                conv.system = system if system is not None else conv.system
            self.sessions[name] = conv
            self.hooks.opened(conv)
        return self.sessions[name]


class ChatHooks:
    """Where the controller meets state: the default keeps everything in memory."""

    save_failed = False  # set by save_cache: the last /save did not write the cache

    def load(self, name: str) -> Conversation | None:
        return None

    def opened(self, conv: Conversation) -> None:
        pass

    def stored_sessions(self) -> list[str]:
        return []

    def save_messages(self, conv: Conversation) -> None:
        pass

    def turn_done(self, conv: Conversation, result: TurnResult) -> None:
        pass

    def list_sessions(self, chat: ChatController) -> list[dict[str, Any]]:
        return [{"name": c.name, "turns": c.turns} for c in chat.sessions.values()]

    def stats(self, chat: ChatController) -> list[dict[str, Any]]:
        last = chat.last_result
        return [r.to_dict() for r in last.rank_stats] if last else []

    def evictions(self, chat: ChatController) -> list[dict[str, Any]]:
        last = chat.last_result
        return [e.to_dict() for e in last.events if e.kind == "evict"] if last else []

    def save_cache(self, chat: ChatController) -> str:
        return "saving KV caches is not available in this mode"


def _fresh_name() -> str:
    return time.strftime("chat-%Y%m%d-%H%M%S")
