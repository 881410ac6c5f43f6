"""Conversations and the slash commands that edit them: no I/O, no MLX.

Both the REPL and script mode feed lines to `ChatController.handle`; it returns
what happened (a turn or a command's message) and the front end renders it.
"""

from __future__ import annotations

import difflib
import secrets
import string
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from exokv.client import Client
from exokv.client.stopwatch import FirstText
from exokv.core.records import TurnRequest, TurnResult
from exokv.errors import ExokvError
from exokv.prompt.render import with_reply_tokens

COMMANDS = {
    "/help": "list the commands and keys",
    "/new": "/new [NAME]  start a new conversation",
    "/switch": "/switch NAME  go back to another conversation",
    "/sessions": "/sessions [all]  the 20 most recent conversations (or all)",
    "/retry": "/retry [--temp F]  regenerate the last reply",
    "/undo": "drop the last exchange",
    "/system": "/system [TEXT|clear]  show, set or clear the system prompt",
    "/set": "/set temp F | max-tokens N  change the sampling settings",
    "/stats": "the cache on each rank",
    "/evictions": "the latest evictions",
    "/save": "save this conversation's KV cache",
    "/pin": "/pin [NAME]  keep this (or NAME's) cache: evicted after every unpinned one",
    "/unpin": "/unpin [NAME]  let this (or NAME's) cache be evicted like any other",
    "/hosts": "/hosts [add|drop NAME]  the hosts and their layers; take one on, or leave one out",
    "/quit": "leave (the conversation and its KV cache are saved)",
}
# Commands that take an argument: Tab completes them with the space after.
TAKES_ARGUMENT = {
    *("/new", "/switch", "/system", "/set", "/sessions", "/retry", "/pin", "/unpin", "/hosts")
}
RECENT_SESSIONS = 20


def plural(n: int, word: str) -> str:
    """`1 turn`, `2 turns`."""
    return f"{n:,} {word}" if n == 1 else f"{n:,} {word}s"


def nearest_command(name: str) -> str | None:
    """The slash command a mistyped one most likely meant, if any is close."""
    close = difflib.get_close_matches(name, list(COMMANDS), n=1, cutoff=0.6)
    if close:
        return close[0]
    prefixed = [c for c in COMMANDS if c.startswith(name) and len(name) > 1]
    return prefixed[0] if len(prefixed) == 1 else None


def fresh_name(taken: Iterable[str]) -> str:
    """A short default session name, unique among `taken` (and across chats started together).

    Random rather than a timestamp: two chats started in the same second, or a /new in
    the same second as the start, must not share (and so merge) a conversation.
    """
    used = set(taken)
    alphabet = string.ascii_lowercase + string.digits
    while True:
        name = "chat-" + "".join(secrets.choice(alphabet) for _ in range(4))
        if name not in used:
            return name


@dataclass
class Conversation:
    """A session's messages. A reply's message keeps the exact tokens generated for it
    (`tokens`, from its turn's result or the store) for every later request."""

    name: str
    system: str | None = None
    messages: list[dict[str, Any]] = field(default_factory=list)

    def prompt(self) -> list[dict[str, Any]]:
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
    speculate: bool = True  # drafts from the conversation checked by the model


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
        self.last_result: TurnResult | None = None
        self._opened_detail: str | None = None
        self.current = self._open(session or fresh_name(self.known_sessions()), system)

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
        if text.startswith("//"):
            line = line.lstrip()[1:]  # `//text` sends `/text` as a message
        elif text.startswith("/"):
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
            self.current = self._open(arg or fresh_name(self.known_sessions()), conv.system)
            kept = " (it keeps the system prompt; /system clear drops it)" if conv.system else ""
            return Outcome(name, f"new session {self.current.name!r}{kept}")
        if name == "/switch":
            return self._switch(arg)
        if name == "/sessions":
            if arg not in ("", "all"):
                return Outcome(name, "usage: /sessions [all]", error=True)
            rows = self.hooks.list_sessions(self)
            older = len(rows) - RECENT_SESSIONS if arg != "all" else 0
            more = f"{plural(older, 'older session')}: /sessions all" if older > 0 else ""
            return Outcome(name, more, data=rows if arg == "all" else rows[:RECENT_SESSIONS])
        if name == "/system":
            return self._system(arg)
        if name == "/set":
            return self._set(arg)
        if name == "/undo":
            if not conv.messages:
                return Outcome(name, "nothing to undo", error=True)
            while conv.messages and conv.messages[-1]["role"] == "assistant":
                conv.messages.pop()
            if conv.messages and conv.messages[-1]["role"] == "user":
                conv.messages.pop()
            self.hooks.save_messages(conv)
            return Outcome(name, f"dropped the last exchange ({plural(conv.turns, 'turn')} left)")
        if name == "/retry":
            return self._retry(arg, on_text, on_progress)
        if name == "/stats":
            return Outcome(name, "", data=self.hooks.stats(self))
        if name == "/evictions":
            return Outcome(name, "", data=self.hooks.evictions(self))
        if name == "/save":
            message = self.hooks.save_cache(self)
            return Outcome(name, message, error=self.hooks.save_failed)
        if name in ("/pin", "/unpin"):
            return self._pin(name, arg)
        if name == "/hosts":
            return self._hosts(arg)
        guess = nearest_command(name)
        hint = f"did you mean {guess}? " if guess else ""
        return Outcome(
            name, f"unknown command {name}; {hint}/help lists them (//text sends /text)", error=True
        )

    def _switch(self, arg: str) -> Outcome:
        if not arg:
            return Outcome("/switch", "usage: /switch NAME", error=True)
        if arg not in self.known_sessions():
            return Outcome("/switch", f"no session {arg!r}; /sessions lists them", error=True)
        if arg == self.current.name:
            return Outcome("/switch", f"already in {arg!r}")
        self._opened_detail = None
        self.current = self._open(arg, None, announce=False)
        turns = plural(self.current.turns, "turn")
        extra = f"; {self._opened_detail}" if self._opened_detail else ""
        return Outcome("/switch", f"switched to {arg!r} ({turns}{extra})")

    def _hosts(self, arg: str) -> Outcome:
        """`/hosts`: each host's state and layers; `/hosts add|drop NAME`: the layers
        placed again, between turns (exokv.client.heal)."""
        verb, _, host = arg.partition(" ")
        host = host.strip()
        if not arg:
            rows = [h.to_dict() for h in self.client.hosts()]
            return Outcome("/hosts", "" if rows else "this chat runs on one machine", data=rows)
        if verb not in ("add", "drop") or not host or " " in host:
            return Outcome("/hosts", "usage: /hosts [add NAME | drop NAME]", error=True)
        try:
            said = self.client.change_hosts(**{verb: host})
        except ExokvError as err:
            return Outcome("/hosts", str(err), error=True)
        return Outcome("/hosts", said)

    def _pin(self, name: str, arg: str) -> Outcome:
        target = arg or self.current.name
        if target not in self.known_sessions():
            return Outcome(name, f"no session {target!r}; /sessions lists them", error=True)
        pin = name == "/pin"
        if (target in self.hooks.pins()) == pin:
            return Outcome(name, f"{target!r} is {'already' if pin else 'not'} pinned")
        self.hooks.set_pinned(target, pin)
        if pin:
            return Outcome(
                name, f"pinned {target!r}: its cache is evicted after every unpinned one"
            )
        return Outcome(name, f"unpinned {target!r}: its cache is evicted like any other")

    def _system(self, arg: str) -> Outcome:
        conv = self.current
        if not arg:
            shown = conv.system if conv.system else "(none)"
            return Outcome("/system", f"system prompt: {shown}")
        conv.system = None if arg == "clear" else arg
        self.hooks.save_messages(conv)
        return Outcome("/system", "system prompt set" if conv.system else "system prompt cleared")

    def _set(self, arg: str) -> Outcome:
        key, _, value = arg.partition(" ")
        value = value.strip()
        s = self.settings
        if not key:
            return Outcome("/set", f"temp {s.temp:g} · max-tokens {s.max_tokens}")
        try:
            if key == "temp":
                temp = float(value)
                if temp < 0:
                    raise ValueError
                s.temp = temp
                return Outcome("/set", f"temp {s.temp:g}")
            if key in ("max-tokens", "max_tokens"):
                count = int(value)
                if count < 1:
                    raise ValueError
                s.max_tokens = count
                return Outcome("/set", f"max-tokens {s.max_tokens}")
        except ValueError:
            return Outcome("/set", f"/set {key}: {value!r} is not a valid value", error=True)
        return Outcome("/set", "usage: /set temp F | /set max-tokens N", error=True)

    def _retry(
        self,
        arg: str,
        on_text: Callable[[str], None] | None,
        on_progress: Callable[[int, int], None] | None,
    ) -> Outcome:
        conv = self.current
        temp = self.settings.temp
        if arg:
            flag, _, value = arg.partition(" ")
            try:
                if flag != "--temp" or float(value) < 0:
                    raise ValueError
                temp = float(value)
            except ValueError:
                return Outcome("/retry", "usage: /retry [--temp F]", error=True)
        if not conv.messages or conv.messages[-1]["role"] != "assistant":
            return Outcome("/retry", "nothing to retry", error=True)
        previous = conv.messages.pop()
        outcome = self._run(on_text, on_progress, command="/retry", previous=previous, temp=temp)
        if temp == 0 and outcome.result is not None:
            outcome.message = (
                "at --temp 0 a retry gives the same reply; /retry --temp 0.7 samples another"
            )
        return outcome

    def known_sessions(self) -> set[str]:
        return set(self.sessions) | set(self.hooks.stored_sessions())

    # -- internals --------------------------------------------------------------

    def _run(
        self,
        on_text: Callable[[str], None] | None,
        on_progress: Callable[[int, int], None] | None,
        command: str | None = None,
        previous: dict[str, Any] | None = None,
        temp: float | None = None,
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
            temp=self.settings.temp if temp is None else temp,
            seed=self.settings.seed,
            use_cache=self.settings.use_cache,
            pins=sorted(self.hooks.pins()),
            speculate=self.settings.speculate,
        )
        shown = FirstText(on_text)  # the TTFT, from Enter (exokv.client.stopwatch)
        try:
            result = shown.stamp(self.client.turn(request, on_text=shown, on_progress=on_progress))
        except BaseException:
            self._undo_attempt(conv, command, previous)
            raise
        if result.finish_reason == "interrupted" and not result.reply:
            self._undo_attempt(conv, command, previous)
            return Outcome(command, "stopped before the reply began; nothing kept")
        reply = {"role": "assistant", "content": result.reply}
        conv.messages.append(with_reply_tokens(reply, result.reply_tokens))
        self.last_result = result
        self.hooks.turn_done(conv, result)
        return Outcome(command, result=result, turn=conv.turns)

    @staticmethod
    def _undo_attempt(
        conv: Conversation, command: str | None, previous: dict[str, Any] | None
    ) -> None:
        # The user line stays only when a reply was produced; /retry gets its old reply back.
        if previous is not None:
            conv.messages.append(previous)
        elif conv.messages and conv.messages[-1]["role"] == "user" and command is None:
            conv.messages.pop()

    def _open(self, name: str, system: str | None, announce: bool = True) -> Conversation:
        if name not in self.sessions:
            stored = self.hooks.load(name)
            conv = stored or Conversation(name=name, system=system)
            if stored is None or (system and not stored.messages):
                conv.system = system if system is not None else conv.system
            self.sessions[name] = conv
            self._opened_detail = self.hooks.opened(conv, announce)
        return self.sessions[name]


class ChatHooks:
    """Where the controller meets state: the default keeps everything in memory."""

    save_failed = False  # set by save_cache: the last /save did not write the cache

    def __init__(self) -> None:
        self._pins: set[str] = set()

    def pins(self) -> set[str]:
        """The pinned sessions (/pin): every turn's request carries them to the ranks."""
        return set(self._pins)

    def set_pinned(self, name: str, pinned: bool) -> None:
        if pinned:
            self._pins.add(name)
        else:
            self._pins.discard(name)

    def load(self, name: str) -> Conversation | None:
        return None

    def opened(self, conv: Conversation, announce: bool = True) -> str | None:
        """A session was opened; unless `announce`, returns what to say about it in one line."""
        return None

    def stored_sessions(self) -> list[str]:
        return []

    def save_messages(self, conv: Conversation) -> None:
        pass

    def turn_done(self, conv: Conversation, result: TurnResult) -> None:
        pass

    def list_sessions(self, chat: ChatController) -> list[dict[str, Any]]:
        pins = self.pins()
        return [
            {"name": c.name, "turns": c.turns, "pinned": c.name in pins}
            for c in chat.sessions.values()
        ]

    def stats(self, chat: ChatController) -> list[dict[str, Any]]:
        last = chat.last_result
        return [r.to_dict() for r in last.rank_stats] if last else []

    def evictions(self, chat: ChatController) -> list[dict[str, Any]]:
        last = chat.last_result
        return [e.to_dict() for e in last.events if e.kind == "evict"] if last else []

    def save_cache(self, chat: ChatController) -> str:
        return "saving KV caches is not available in this mode"

    def attach(
        self, warn: Callable[[str], None] | None = None, note: Callable[[str], None] | None = None
    ) -> None:
        """Where the hooks' own lines go once the REPL draws the screen; kept in memory:
        nothing to say."""

    def finish(self, chat: ChatController) -> None:
        """On quit; kept in memory: nothing to save."""
