"""`exokv bench --ranks N`: the front end that runs the bench on ranks started by mlx.launch.

Every rank runs `exokv.bench.rank_main` (the same runner loop on its shard of the
model); rank 0 streams its progress and finally the JSON document on its stdout,
which the launcher relays here. The front end renders that document exactly as
for one rank.

Time bounds: every rank must say it is alive (a heartbeat on stderr) within
`START_TIMEOUT` of the launch and then at least every `HEARTBEAT_TIMEOUT`; the
launcher exiting without a document, or with an error, is a one-line error
naming the rank (`exokv.launch.supervise`, which the chat's ranks go through too).
Whatever happens, the launcher's whole process group (the launcher and every
rank) is ended.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import threading
import time
from dataclasses import asdict
from typing import Any

from exokv.bench.rank_main import DOC_MARK, PROGRESS_MARK
from exokv.errors import ExokvError
from exokv.launch.command import LaunchPlan, plan_launch, rank_command
from exokv.launch.supervise import Supervisor
from exokv.model.resolve import resolve_model

START_TIMEOUT = 90.0  # launcher start + distributed init, until every rank beats
# Ranks beat every 2 s, from a thread, even while MLX computes. Twice the chat's 10 s:
# nobody waits at a prompt here (the chat promises to notice a lost rank within 15 s),
# and a false alarm costs the whole run.
HEARTBEAT_TIMEOUT = 20.0
EXIT_TIMEOUT = 30.0  # after the document: the ranks finish and the launcher exits
CONSEQUENCE = "the bench cannot go on"  # follows a cause that only says how a rank ended
_POLL_S = 0.25


def bench_command(settings: dict[str, Any]) -> list[str]:
    """The argv of one rank: the bench settings as one JSON argument."""
    return [*rank_command(module="exokv.bench.rank_main"), json.dumps(settings)]


def run_on_ranks(
    config: Any,
    progress: Any,
    starting_port: int | None = None,
    backend: str = "ring",
) -> dict[str, Any]:
    """Run the bench on `config.ranks` local ranks; rank 0's JSON document."""
    settings = {"config": asdict(config), "backend": backend, "front_end_pid": os.getpid()}
    plan = plan_launch(
        bench_command(settings),
        ranks=config.ranks,
        backend=backend,
        starting_port=starting_port,
    )
    resolve_model(config.model)  # a missing model is one line here; builtins made once
    return RankRun(plan, progress).run()


class RankRun:
    """One bench on the ranks of `plan`: its progress shown, rank 0's document returned."""

    def __init__(self, plan: LaunchPlan, progress: Any) -> None:
        self.plan = plan
        self.progress = progress
        self.lines: queue.Queue[tuple[str, str]] = queue.Queue()
        self.supervisor = Supervisor(
            plan, HEARTBEAT_TIMEOUT, start_timeout=START_TIMEOUT, on_line=self._take
        )

    def run(self) -> dict[str, Any]:
        # SIGTERM (a script's timeout, say) ends the ranks too, as Ctrl-C does.
        previous = signal.getsignal(signal.SIGTERM)
        on_main = threading.current_thread() is threading.main_thread()
        if on_main:
            signal.signal(signal.SIGTERM, _terminated)
        try:
            return self._run()
        finally:
            self.close()
            if on_main:
                signal.signal(signal.SIGTERM, previous)

    def _run(self) -> dict[str, Any]:
        ranks = self.supervisor
        ranks.start()
        doc: dict[str, Any] | None = None
        doc_at = 0.0
        while True:
            try:
                kind, text = self.lines.get(timeout=_POLL_S)
            except queue.Empty:
                kind, text = "idle", ""
            if kind == "progress":
                self._progress(text)
            elif kind == "doc":
                doc, doc_at = json.loads(text), time.monotonic()
            now = time.monotonic()
            code = ranks.poll()
            if code is not None:
                ranks.drained(2.0)  # the last lines (the document) reach the queue
                doc = doc or self._drain_queue()
                if code == 0 and doc is not None:
                    return doc
                if code == 0:
                    self._fail("the ranks finished without a result from rank 0")
                self._fail(f"the launcher exited with code {code}")
            if doc is not None:
                if now - doc_at > EXIT_TIMEOUT:
                    return doc  # the result is in; close() ends what is left
                continue
            silent = ranks.silent()
            if silent is not None:
                self._fail(silent, settle=False)

    def _take(self, stream: str, line: str) -> bool:
        """Rank 0's marked lines on stdout: the progress and the document."""
        if stream != "stdout":
            return False
        for mark, kind in ((DOC_MARK, "doc"), (PROGRESS_MARK, "progress")):
            if line.startswith(mark):
                self.lines.put((kind, line[len(mark) :]))
                return True
        return False

    def _drain_queue(self) -> dict[str, Any] | None:
        doc = None
        while True:
            try:
                kind, text = self.lines.get_nowait()
            except queue.Empty:
                return doc
            if kind == "doc":
                doc = json.loads(text)

    def _progress(self, text: str) -> None:
        try:
            message = json.loads(text)
        except ValueError:
            return
        if "total" in message:
            self.progress.start(int(message["total"]), str(message.get("estimate", "")))
        elif "advance" in message:
            self.progress.advance(str(message["advance"]))

    def _fail(self, trouble: str, settle: bool = True) -> None:
        cause = self.supervisor.diagnose(trouble, settle)
        self.close()
        raise ExokvError(cause.worded(CONSEQUENCE))

    def close(self) -> None:
        """End the launcher and every rank (its process group), then wait for them."""
        self.supervisor.end()


def _terminated(signum: int, frame: Any) -> None:
    raise ExokvError("terminated: the ranks were stopped")
