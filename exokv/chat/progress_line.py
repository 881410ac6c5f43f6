"""Script mode's sign of life: a long prefill as one updating line on a terminal's stderr.

`exokv chat` reading its turns from a pipe or a file prints nothing until the first
token, and a long paste can take minutes to prefill. When stderr is a terminal and a
turn has prefilled for `AFTER_S`, one line says how far it is and how long is left
(exokv.chat.eta), rewritten in place at most `EVERY_S`, and erased before the reply
or the next line: stdout (the reply, or --json's objects) never sees it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import IO

from exokv.chat.eta import PrefillClock, clock_text

AFTER_S = 2.0  # a prefill shorter than this shows nothing
EVERY_S = 0.25  # the line is rewritten no more often than this
ERASE = "\r\x1b[K"  # back to the line's start, and clear it


class ProgressLine:
    """on_progress for one turn at a time: `start()` before it, `clear()` after it (and
    before the reply's first text)."""

    def __init__(self, err: IO[str], clock: Callable[[], float] = time.perf_counter) -> None:
        self.err = err
        self.now = clock
        self._started = 0.0
        self._eta = PrefillClock()
        self._written = 0.0  # when the line was last written (0: not shown)

    def start(self) -> None:
        self._started = self.now()
        self._eta = PrefillClock()
        self._written = 0.0

    def __call__(self, done: int, total: int) -> None:
        now = self.now()
        self._eta.report(now, done)
        if now - self._started < AFTER_S or now - self._written < EVERY_S or done >= total:
            return
        left = self._eta.left(total)
        text = f"exokv: prefill {done:,}/{total:,} tokens"
        if left is not None:
            text += f" · {clock_text(left)} left"
        self.err.write(ERASE + text)
        self.err.flush()
        self._written = now

    def clear(self) -> None:
        if self._written:
            self.err.write(ERASE)
            self.err.flush()
            self._written = 0.0


def for_stderr(err: IO[str]) -> ProgressLine | None:
    """A ProgressLine when `err` is a terminal, else None (a log file gets no line)."""
    try:
        return ProgressLine(err) if err.isatty() else None
    except (AttributeError, ValueError):  # closed or not a real file
        return None
