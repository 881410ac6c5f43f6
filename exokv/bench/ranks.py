"""`exokv bench --ranks N`: the front end that runs the bench on ranks started by mlx.launch.

Every rank runs `exokv.bench.rank_main` (the same runner loop on its shard of the
model); rank 0 streams its progress and finally the JSON document on its stdout,
which the launcher relays here. The front end renders that document exactly as
for one rank.

Time bounds: every rank must say it is alive (a heartbeat on stderr) within
`START_TIMEOUT` of the launch and then at least every `HEARTBEAT_TIMEOUT`; the
launcher exiting without a document, or with an error, is a one-line error
naming the rank (`exokv.client.cluster.diagnose`). Whatever happens, the
launcher's whole process group (the launcher and every rank) is ended.
"""

from __future__ import annotations

import collections
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from typing import IO, Any

from exokv.bench.rank_main import DOC_MARK, PROGRESS_MARK
from exokv.client.cluster import diagnose
from exokv.errors import ExokvError
from exokv.wire.launch import (
    BEAT_MARK,
    LaunchPlan,
    end_process_group,
    nudge_ranks,
    plan_launch,
    rank_command,
    wait_for,
)

START_TIMEOUT = 90.0  # launcher start + distributed init, until every rank beats
HEARTBEAT_TIMEOUT = 20.0  # ranks beat every 2 s, from a thread, even while MLX computes
EXIT_TIMEOUT = 30.0  # after the document: the ranks finish and the launcher exits
NUDGE_S = 2.0
_POLL_S = 0.25
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_BEAT = re.compile(re.escape(BEAT_MARK) + r"(\d+)")


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
    from exokv.model.resolve import resolve_model

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
    def __init__(self, plan: LaunchPlan, progress: Any) -> None:
        self.plan = plan
        self.progress = progress
        self.proc: subprocess.Popen[bytes] | None = None
        self.lines: queue.Queue[tuple[str, str] | None] = queue.Queue()
        self.stderr_tail: collections.deque[str] = collections.deque(maxlen=200)
        self.stdout_tail: collections.deque[str] = collections.deque(maxlen=50)
        self.beats: dict[int, float] = {}
        self.drains: list[threading.Thread] = []

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
        self.proc = subprocess.Popen(
            self.plan.argv,
            stdin=subprocess.PIPE,  # kept open: at end of file mlx.launch spins on it
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # own process group: one kill ends every rank
        )
        for name, stream in (("stdout", self.proc.stdout), ("stderr", self.proc.stderr)):
            assert stream is not None
            t = threading.Thread(target=self._drain, args=(name, stream), daemon=True)
            t.start()
            self.drains.append(t)
        started = time.monotonic()
        last_nudge = started
        doc: dict[str, Any] | None = None
        doc_at = 0.0
        while True:
            try:
                item = self.lines.get(timeout=_POLL_S)
            except queue.Empty:
                item = ("idle", "")
            kind, text = item if item is not None else ("idle", "")
            if kind == "progress":
                self._progress(text)
            elif kind == "doc":
                doc, doc_at = json.loads(text), time.monotonic()
            now = time.monotonic()
            if now - last_nudge > NUDGE_S:
                nudge_ranks(self.proc)
                last_nudge = now
            code = self.proc.poll()
            if code is not None:
                for t in self.drains:
                    t.join(timeout=2.0)  # the last lines (the document) reach the queue
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
            missing = [r for r in range(self.plan.ranks) if r not in self.beats]
            if missing and now - started > START_TIMEOUT:
                self._fail(
                    f"rank {missing[0]} did not start within {START_TIMEOUT:.0f} s "
                    "(the launcher or the distributed setup hangs)",
                    settle=False,
                )
            silent = [r for r, t in sorted(self.beats.items()) if now - t > HEARTBEAT_TIMEOUT]
            if silent:
                self._fail(
                    f"rank {silent[0]} stopped responding (no heartbeat for "
                    f"{HEARTBEAT_TIMEOUT:.0f} s)",
                    settle=False,
                )

    def _drain_queue(self) -> dict[str, Any] | None:
        doc = None
        while True:
            try:
                item = self.lines.get_nowait()
            except queue.Empty:
                return doc
            if item is not None and item[0] == "doc":
                doc = json.loads(item[1])

    def _progress(self, text: str) -> None:
        try:
            message = json.loads(text)
        except ValueError:
            return
        if "total" in message:
            self.progress.start(int(message["total"]))
        elif "advance" in message:
            self.progress.advance(str(message["advance"]))

    def _drain(self, name: str, stream: IO[bytes]) -> None:
        debug = os.environ.get("EXOKV_DEBUG", "") not in ("", "0")
        for raw in iter(stream.readline, b""):
            line = _ANSI.sub("", raw.decode(errors="replace")).rstrip("\r\n")
            if name == "stdout":
                if line.startswith(DOC_MARK):
                    self.lines.put(("doc", line[len(DOC_MARK) :]))
                    continue
                if line.startswith(PROGRESS_MARK):
                    self.lines.put(("progress", line[len(PROGRESS_MARK) :]))
                    continue
                self.stdout_tail.append(line)
            else:
                beat = _BEAT.search(line)
                if beat:
                    self.beats[int(beat.group(1))] = time.monotonic()
                    continue
                self.stderr_tail.append(line)
            if debug:
                print(f"[ranks {name}] {line}", file=sys.stderr)
        stream.close()

    def _fail(self, cause: str, settle: bool = True) -> None:
        proc = self.proc
        if proc is not None and settle:
            wait_for(proc, 4.0)
            for t in self.drains:
                t.join(timeout=1.0)
        hosts = [h.ssh for h in self.plan.hosts]
        message = diagnose(list(self.stderr_tail), cause, hosts) if settle else cause
        self.close()
        raise ExokvError(message.replace("the chat cannot go on", "the bench cannot go on"))

    def close(self) -> None:
        """End the launcher and every rank (its process group), then wait for them."""
        proc = self.proc
        if proc is None:
            return
        end_process_group(proc)
        for t in self.drains:
            t.join(timeout=1.0)


def _terminated(signum: int, frame: Any) -> None:
    raise ExokvError("terminated: the ranks were stopped")
