"""SIGTERM and SIGHUP end a chat the way /quit does, not in the middle of nothing.

Python's default for both is to die at once, which skips every `finally`: the ranks'
KV cache would never reach the disk tier, and a closed terminal window (SIGHUP) or
a `kill` would cost the next chat a cold prefill of everything. Inside
`ended_by_signals()` the first of them raises `Terminated` in the main thread, so the
chat unwinds like Ctrl-C at the top (the store closed, the ranks shut down, what RAM
holds spilled); a second one while that runs is ignored (SIGKILL still ends it at
once). `Terminated` is a BaseException, as KeyboardInterrupt is, so that no handler
of errors on the way (the REPL shows a failed turn's error and goes on) swallows it.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

SIGNALS = (signal.SIGTERM, signal.SIGHUP)


class Terminated(BaseException):  # noqa: N818 - named like KeyboardInterrupt
    """The chat was asked to end by a signal; the exit code is 128 + its number."""

    def __init__(self, signum: int) -> None:
        name = signal.Signals(signum).name
        super().__init__(f"terminated by {name}; the conversation and its KV cache are kept")
        self.exit_code = 128 + signum


@contextmanager
def ended_by_signals() -> Iterator[None]:
    fired = False

    def handler(signum: int, _frame: FrameType | None) -> None:
        nonlocal fired
        if fired:
            return  # already unwinding: let the cache reach the disk
        fired = True
        raise Terminated(signum)

    if threading.current_thread() is not threading.main_thread():
        yield  # signals reach the main thread only (a chat run from a test's thread)
        return
    previous = {sig: signal.signal(sig, handler) for sig in SIGNALS}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
