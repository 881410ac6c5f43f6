"""How far a long step on this machine has got (a GGUF conversion), shown on stderr.

On a terminal one line is rewritten in place (a few times a second at most, and
every half second while a phase with no count of its own runs, such as the GGUF
reader parsing a large vocabulary); in a log or a test (stderr not a terminal) a
plain line at each quarter, so a run that is captured gets a few lines, not a flood.
"""

from __future__ import annotations

import sys
import threading
import time
from types import TracebackType
from typing import TextIO

from exokv.core.sizes import format_size

# A terminal's line is redrawn at most this often when counts arrive...
_REDRAW_S = 0.2
# ...and this often while none do.
_TICK_S = 0.5
# Where a log gets a line: each quarter of the work.
_QUARTERS = (25, 50, 75)


class StepProgress:
    """Called as ``(done, total)`` bytes of step ``label`` as it goes; used as a context.

    Until the first call the terminal's line says ``before`` and the time spent.
    """

    def __init__(self, label: str, before: str, stream: TextIO | None = None) -> None:
        self.label = label
        self.before = before
        self.total = 0  # 0: no count yet
        self.done = 0
        self.stream = stream if stream is not None else sys.stderr
        self.live = _is_terminal(self.stream)
        self._start = time.monotonic()
        self._drawn = 0.0
        self._shown = False  # a terminal line is on screen
        self._said = 0  # quarters already written to a log
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None

    def __enter__(self) -> StepProgress:
        if self.live:
            self._ticker = threading.Thread(target=self._tick, daemon=True)
            self._ticker.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join()
        with self._lock:
            self._clear()

    def __call__(self, done: int, total: int) -> None:
        with self._lock:
            self.total = max(total, 1)
            self.done = min(done, self.total)
            percent = self.done * 100 // self.total
            if self.live:
                now = time.monotonic()
                if now - self._drawn >= _REDRAW_S or self.done == self.total:
                    self._draw()
                return
            crossed = [q for q in _QUARTERS[self._said :] if percent >= q]
            if crossed:
                self._said += len(crossed)
                self._write(self._line(crossed[-1]) + "\n")

    def say(self, text: str) -> None:
        """A line of its own, above the progress line on a terminal."""
        with self._lock:
            self._clear()
            self._write(f"exokv: {text}\n")
            if self.live:
                self._draw()

    def _tick(self) -> None:
        while not self._stop.wait(_TICK_S):
            with self._lock:
                if time.monotonic() - self._drawn >= _TICK_S:
                    self._draw()

    def _draw(self) -> None:
        self._drawn = time.monotonic()
        self._shown = True
        self._write(f"\r\x1b[2K{self._line(self.done * 100 // max(self.total, 1))}")

    def _clear(self) -> None:
        if self._shown:
            self._write("\r\x1b[2K")
            self._shown = False

    def _line(self, percent: int) -> str:
        took = time.monotonic() - self._start
        if not self.total:
            return f"exokv: {self.before} ({took:.0f}s)"
        done = format_size(self.done, "decimal")
        total = format_size(self.total, "decimal")
        return f"exokv: {self.label}: {percent}% ({done} of {total}, {took:.1f}s)"

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):
            pass  # a closed or broken stderr: the work goes on unseen


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
