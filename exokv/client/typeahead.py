"""The local engine's typed-ahead drafts: run in a thread of their own, a step at a time.

Typing never waits for the model: `submit` hands the newest draft over and returns. The
worker runs one typeahead step at a time under the engine's lock, so a turn (which
takes the lock after `cancel`) waits at most for the step in flight, and uses it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

Step = Callable[[str, list[dict[str, str]], str], int]  # Engine.typeahead_step


class DraftRunner:
    def __init__(
        self, step: Step, lock: threading.Lock, at_exit: Callable[[], None] | None = None
    ) -> None:
        self._step = step
        self.lock = lock  # the engine's: held by every step and every turn
        self._at_exit = at_exit  # run by the worker as it ends (see close)
        self._wake = threading.Condition()
        self._pending: tuple[str, list[dict[str, str]], str] | None = None
        self._serial = 0  # drafts submitted (a waiter knows when its draft is over)
        self._over = 0  # the latest draft that got its last step or was given up
        self._thread: threading.Thread | None = None
        self._closed = False

    def submit(self, session: str, messages: list[dict[str, str]], text: str) -> int:
        """Make `text` the draft to run (the one before is given up); "" abandons it."""
        with self._wake:
            self._serial += 1
            self._over = self._serial - 1
            self._pending = (session, list(messages), text) if text and not self._closed else None
            if self._pending is None:
                self._over = self._serial
            elif self._thread is None:
                self._thread = threading.Thread(target=self._run, name="exokv-drafts", daemon=True)
                self._thread.start()
            self._wake.notify_all()
            return self._serial

    def wait(self, serial: int, timeout: float | None = None) -> None:
        with self._wake:
            self._wake.wait_for(lambda: self._over >= serial, timeout)

    def cancel(self) -> None:
        """No more steps for the draft (a turn is about to use what it prefilled)."""
        self.submit("", [], "")

    def close(self) -> None:
        """No more drafts; returns once the worker has ended, having run `at_exit`.

        A thread that ran the model must free MLX's thread-local state (its compile
        cache holds Python objects) before it ends: freed later, as the thread ends,
        it needs the GIL, and if the interpreter is exiting then the process aborts
        ("terminate called without an active exception", exit 134)."""
        with self._wake:
            self._closed = True
            worker = self._thread
        self.cancel()
        if worker is not None and worker is not threading.current_thread():
            worker.join()

    def _run(self) -> None:
        try:
            self._serve()
        finally:
            if self._at_exit is not None:
                self._at_exit()

    def _serve(self) -> None:
        while True:
            with self._wake:
                self._wake.wait_for(lambda: self._pending is not None or self._closed)
                if self._closed:
                    return
                job, serial = self._pending, self._serial
            with self.lock:
                with self._wake:
                    if serial != self._serial:
                        continue  # replaced while waiting for the lock
                assert job is not None
                try:
                    left = self._step(*job)
                except Exception:  # noqa: BLE001 - a draft is only ever a head start
                    left = 0
            with self._wake:
                if serial == self._serial and left <= 0:
                    self._pending = None
                    self._over = serial
                    self._wake.notify_all()
