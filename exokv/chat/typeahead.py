"""The REPL's draft watcher: what the user is typing goes to the ranks before Enter.

prompt-toolkit calls `_changed` on its event loop for every edit of the line; that only
notes the text and the time. A thread of its own decides when to send (a short pause
in typing, at least every second while typing goes on, at once after a paste) and
calls `Client.draft`, so a slow channel or a
busy engine never delays a keystroke. Only the draft's stable part matters to the ranks
(exokv.rank.typeahead), so a draft is sent again only when that part changed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from exokv.client import Client
from exokv.core.records import DraftCost
from exokv.rank.typeahead import stable_text

PAUSE_S = 0.3  # typing paused this long: the draft goes to the ranks
EVERY_S = 1.0  # and while typing goes on, a changed draft goes at least this often
PASTE_CHARS = 32  # one edit adding this many characters is a paste: sent at once

Conversation = Callable[[], tuple[str, list[dict[str, str]]]]  # (session, its messages)
MIN_MEASURED = 64  # a turn that prefilled fewer tokens says little about the speed


class PrefillSpeed:
    """Prefill tokens per second, measured from the turns' own numbers (what a prefill
    after Enter took), so the toolbar's estimate is this model's on these ranks."""

    def __init__(self) -> None:
        self.tps: float | None = None

    def turn(self, prefilled: int, ttft_s: float) -> None:
        if prefilled >= MIN_MEASURED and ttft_s > 0:
            seen = prefilled / ttft_s
            self.tps = seen if self.tps is None else 0.5 * (self.tps + seen)


def toolbar_text(cost: DraftCost | None, tps: float | None) -> str:
    """The bottom toolbar while a draft is typed: what Enter will cost."""
    if cost is None or not cost.tokens:
        return ""
    left = max(cost.tokens - cost.cached, 0)
    parts = [f"draft {cost.tokens:,} tokens", f"{min(cost.cached, cost.tokens):,} cached"]
    if tps:
        wait = left / tps
        parts.append(f"Enter ≈ {wait * 1000:.0f} ms" if wait < 1 else f"Enter ≈ {wait:.1f} s")
        parts[-1] += " to the first token"
    return " · ".join(parts)


class DraftWatcher:
    def __init__(self, client: Client, conversation: Conversation, pause: float = PAUSE_S):
        self.client = client
        self.conversation = conversation
        self.pause = pause
        self._wake = threading.Condition()
        self._text = ""
        self._edited = 0.0  # when the line last changed
        self._paste = False
        self._waiting = 0.0  # since when the stable part differs from what was sent
        self._sent = ""  # the stable part the ranks have (or are prefilling)
        self._held = True  # between prompts: a turn or a command runs
        self._sending = threading.Lock()  # hold() returns only once no send is under way
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="exokv-typeahead", daemon=True)
        self._thread.start()

    def cost(self) -> DraftCost | None:
        """What the ranks said of the draft being typed (None: nothing known, or no
        draft): the client's numbers of the last draft step the ranks finished."""
        with self._wake:
            if self._held or not self._sent:
                return None
        session, _ = self.conversation()
        try:
            return self.client.draft_cost(session)
        except Exception:  # noqa: BLE001 - the toolbar never fails a prompt
            return None

    def attach(self, buffer: Any) -> None:
        """Watch a prompt-toolkit Buffer (the PromptSession's line)."""
        buffer.on_text_changed += self._changed

    def resume(self) -> None:
        """A new prompt: the line is empty and drafts may go again."""
        with self._wake:
            self._text, self._paste, self._held = "", False, False

    def hold(self, abandon: bool = False) -> None:
        """The line was entered: no draft goes out until `resume`. A message's turn
        follows whatever was sent, so the ranks prefill only what is new since; with
        `abandon` (Ctrl-C, a command such as /new or /switch) the ranks stop prefilling."""
        with self._sending:
            with self._wake:
                self._held = True
                sent, self._sent = self._sent, ""
            if abandon and sent:
                session, _ = self.conversation()
                self._send(session, [], "")

    def _send(self, session: str, messages: list[dict[str, str]], text: str) -> None:
        try:
            self.client.draft(session, messages, text)
        except Exception:  # noqa: BLE001 - a draft is a head start, never an error
            pass

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify_all()

    def _changed(self, buffer: Any) -> None:
        text = buffer.text
        with self._wake:
            self._paste = self._paste or len(text) - len(self._text) >= PASTE_CHARS
            self._text = text
            self._edited = time.monotonic()
            if not self._waiting:
                self._waiting = self._edited
            self._wake.notify_all()

    def _due(self) -> float | None:
        """Seconds until the draft should go (0: now); None: nothing to send."""
        if self._held or self._closed or stable_text(self._text) == self._sent:
            return None
        if self._paste:
            return 0.0
        due = min(self._edited + self.pause, (self._waiting or self._edited) + EVERY_S)
        return max(0.0, due - time.monotonic())

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._closed:
                    due = self._due()
                    if due == 0.0:
                        break
                    self._wake.wait(due)
                if self._closed:
                    return
            with self._sending:
                with self._wake:
                    if self._due() != 0.0:
                        continue  # held, or changed back, while waiting for the lock
                    text, self._paste, self._waiting = self._text, False, 0.0
                    self._sent = stable_text(text)
                session, messages = self.conversation()
                self._send(session, messages, text if self._sent else "")
