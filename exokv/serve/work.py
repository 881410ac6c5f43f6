"""The queue between the HTTP requests and the client: turns in batches, bounded.

Requests wait in a bounded queue (a full one is a 503 with Retry-After) and one
worker thread feeds them to the client: with `batch` 1, one at a time through the
same `client.turn` the chat calls; above, every waiting job (up to `batch`) at once
through `client.turns`, which decodes them together (exokv.rank.batch), and a lone
job still through `client.turn`; a batch's first job waits a few ms
(`gather_s`) for the requests sent with it. A job seeded for sampling runs alone (a seed is
reproducible only so). Each job's text and its end travel back to the event
loop on an asyncio queue. A job whose client went away is skipped if it still waits,
or stopped with the client's own stop (the chat's Ctrl-C path: every rank ends the
reply at the same token, and the cache keeps what was computed, as after a Ctrl-C).
"""

from __future__ import annotations

import asyncio
import queue
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from exokv.client import Client
from exokv.core.records import BatchCalls, RowOutcome, TurnRequest, TurnResult
from exokv.errors import ExokvError, PromptTooLong
from exokv.rank.stops import TextStops
from exokv.serve.errors import ApiError

RETRY_AFTER_S = 1
# After close() stops what runs, how long the ranks get to end it (they end a stopped
# turn or row within a decode step). Past it the requests still open fail with a 503,
# so each stream gets its last chunk and the server can exit, rather than wait on a
# stop that never lands.
STOPPED_WITHIN_S = 30.0


class Job:
    """One request's turn, between the event loop (which reads `events`) and the worker."""

    def __init__(
        self,
        request: TurnRequest,
        stops: list[str],
        loop: asyncio.AbstractEventLoop,
        prompt_field: str = "messages",
    ) -> None:
        self.request = request
        self.prompt_field = prompt_field  # the request's field a too-long prompt is in
        self.stop_text = TextStops(stops)
        self.loop = loop
        self.events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self.cancelled = threading.Event()  # the client went away
        self.stop_asked = False  # the client's stop was called for this job
        self.finished = False  # its last event was sent
        self.submitted = time.perf_counter()
        self.first_text: float | None = None  # when its first text was sent
        self.reply = ""  # the text sent: the reply, cut at a stop string
        self.result: TurnResult | None = None
        self.batch = 1  # requests decoded together with this one (the access log says)

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_text is None else self.first_text - self.submitted

    def _emit(self, kind: str, value: Any) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))

    def text(self, piece: str) -> None:
        if piece:
            if self.first_text is None:
                self.first_text = time.perf_counter()
            self.reply += piece
            self._emit("text", piece)

    def done(self, result: TurnResult) -> None:
        self.result = result
        self.finished = True
        self._emit("done", result)

    def fail(self, error: ApiError) -> None:
        self.finished = True
        self._emit("error", error)


class TurnQueue:
    """A bounded queue of jobs and the one thread that runs them through the client:
    up to `batch` waiting jobs at a time, decoded together."""

    def __init__(
        self,
        client: Client,
        size: int,
        record: Callable[[Job], None] | None = None,
        on_failure: Callable[[str], None] | None = None,
        batch: int = 1,
        gather_s: float = 0.0,
    ) -> None:
        self.client = client
        self.batch = max(1, batch)
        self.gather_s = max(0.0, gather_s)  # how long a batch's first job waits for more
        self._rows: list[Job] = []  # the batch being decoded, if any
        self._halt = False  # close(): every row of the batch stops
        self.record = record  # called in the worker after each turn that ran
        self.on_failure = on_failure  # the ranks are gone: the server must end
        self._jobs: queue.Queue[Job | None] = queue.Queue(maxsize=size)
        self._held: list[Job] = []  # came during a batch, cannot join it: run after it
        self._last = False  # close() was seen: the worker ends after what it holds
        self._current: Job | None = None
        self._lock = threading.Lock()
        self._closing = False
        self.stopped_within_s = STOPPED_WITHIN_S
        self._stopped_by: float | None = None  # the first close()'s bound, kept by later ones
        self._thread = threading.Thread(target=self._work, name="exokv-serve-turns", daemon=True)
        self._thread.start()

    @property
    def waiting(self) -> int:
        return self._jobs.qsize()

    @property
    def busy(self) -> bool:
        return self._current is not None or bool(self._rows)

    def submit(self, job: Job) -> None:
        if self._closing:
            raise ApiError(503, "the server is shutting down", headers={"Retry-After": "5"})
        try:
            self._jobs.put_nowait(job)
            if self._rows:  # a batch is in flight: the job may join it at its next step
                nudge = getattr(self.client, "nudge", None)
                if nudge is not None:
                    nudge()
        except queue.Full:
            raise ApiError(
                503,
                f"the server is busy: {self._jobs.maxsize} requests are waiting; retry later",
                code="queue_full",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            ) from None

    def cancel(self, job: Job) -> None:
        """The client of `job` went away: skip it, or stop its reply on every rank now
        (not at the next message from the ranks, which a busy front end reads late)."""
        job.cancelled.set()
        with self._lock:
            if self._current is job:
                self._stop(job)
            elif job in self._rows:
                self.client.stop_row(self._rows.index(job))

    def close(self, timeout: float) -> None:
        """Take no more jobs; wait up to `timeout` for the queued and running ones, then
        stop the running one and wait for the ranks to end it (the caches stay alike),
        up to `stopped_within_s`; what is still open then fails (503)."""
        self._closing = True
        deadline = time.monotonic() + timeout
        while (self.busy or self.waiting) and time.monotonic() < deadline:
            time.sleep(0.05)
        while True:  # what still waits is not run
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.fail(_shutting_down())
        with self._lock:
            self._halt = True  # a batch's rows see it at their next decode step
            if self._current is not None:
                self._stop(self._current)
            for row in range(len(self._rows)):
                self.client.stop_row(row)
        self._jobs.put(None)
        if self._stopped_by is None:  # a second close() (the server's end) waits no longer
            self._stopped_by = time.monotonic() + self.stopped_within_s
        self._thread.join(max(0.0, self._stopped_by - time.monotonic()))
        if self._thread.is_alive():
            with self._lock:
                still = [j for j in [self._current, *self._rows] if j and not j.finished]
            for job in still:
                job.fail(_shutting_down())

    # -- the worker ---------------------------------------------------------------

    def _stop(self, job: Job) -> None:
        if not job.stop_asked:
            job.stop_asked = True
            self.client.stop_now()

    def _work(self) -> None:
        try:
            self._run_jobs()
        finally:
            # A one-rank server runs the model in this thread: MLX's state for it must
            # be freed before the thread ends, or exiting can abort (see client.local).
            self.client.release_thread()

    def _run_jobs(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            jobs = [job]
            # Requests sent together arrive a few ms apart: the first waits up to
            # `gather_s` for the others, or it would run alone and they after it.
            deadline = time.monotonic() + (self.gather_s if self.batch > 1 else 0.0)
            while len(jobs) < self.batch:  # the others waiting now join it
                more = self._take(max(0.0, deadline - time.monotonic()))
                if more is None:
                    break
                jobs.append(more)
            jobs = [j for j in jobs if not _left_before_run(j)]
            alone = [j for j in jobs if not _joinable(j)]
            together = [j for j in jobs if j not in alone]
            # A client without `turns` (a wrapper that does not pass it on) runs each
            # alone. Above --batch 1 even a lone job runs as a batch, one that later
            # requests join at a decode step (exokv.rank.batch).
            if together and self.batch > 1 and hasattr(self.client, "turns"):
                with self._lock:
                    self._rows = together
                try:
                    self._run_batch(together)
                finally:
                    with self._lock:
                        self._rows = []
            else:
                alone = together + alone
            alone += self._held  # jobs that came during the batch but could not join it
            self._held = []
            for job in alone:
                with self._lock:
                    self._current = job
                try:
                    self._run(job)
                finally:
                    with self._lock:
                        self._current = None
            if self._last:
                return

    def _take(self, timeout: float = 0.0) -> Job | None:
        """The next waiting job, waiting up to `timeout` for one; None when none came or
        close() did (then nothing more comes: `_last`)."""
        try:
            job = self._jobs.get(timeout=timeout) if timeout > 0 else self._jobs.get_nowait()
        except queue.Empty:
            return None
        if job is None:
            self._last = True
        return job

    def _joins(self, jobs: list[Job]) -> list[TurnRequest]:
        """The waiting jobs that join the batch in flight now, up to `batch` rows in all
        (rows whose answer has not come count): appended to `jobs`, their requests out."""
        if self._halt or self._closing or self._last:
            return []
        free = self.batch - sum(1 for j in jobs if not j.finished)
        joined: list[TurnRequest] = []
        while free > 0:
            job = self._take()
            if job is None:
                break
            if _left_before_run(job):
                continue
            if not _joinable(job):
                self._held.append(job)
                continue
            with self._lock:  # cancel() looks a row up in the same list
                jobs.append(job)
            joined.append(job.request)
            free -= 1
        return joined

    def _run_batch(self, jobs: list[Job]) -> None:
        def on_text(i: int, piece: str) -> None:
            job = jobs[i]
            if not (job.cancelled.is_set() or job.stop_text.hit):
                job.text(job.stop_text.stream(piece))

        def should_stop(i: int) -> bool:
            job = jobs[i]
            return self._halt or job.cancelled.is_set() or job.stop_text.hit

        def on_row(i: int, outcome: RowOutcome) -> None:
            # A row's answer as soon as it ended, not when the batch's longest row ends.
            job = jobs[i]
            if job.finished:
                return
            job.batch = outcome.batch
            if outcome.refused is not None:
                job.fail(_too_long(job, outcome.tokens, outcome.context))
            elif outcome.result is not None:
                self._finish(job, outcome.result)

        try:
            calls = BatchCalls(on_text, should_stop, on_row, joins=lambda: self._joins(jobs))
            outcomes = self.client.turns([j.request for j in jobs], calls)
        except Exception as err:  # noqa: BLE001 - the batch fails, the server stays up
            for job in jobs:
                if not job.finished:
                    self._failed(job, err)
            return
        for i, outcome in enumerate(outcomes):  # a client that does not call on_row
            on_row(i, outcome)

    def _failed(self, job: Job, err: Exception) -> None:
        """A turn that raised: the request's error, and the server's end if the ranks are gone."""
        if isinstance(err, PromptTooLong):
            job.fail(_too_long(job, err.tokens, err.context))
        elif isinstance(err, ExokvError):
            job.fail(ApiError(500, f"the turn failed: {err}"))
            failure = self.client.failure  # the ranks are gone
            if failure and self.on_failure is not None:
                self.on_failure(failure)
        else:
            job.fail(ApiError(500, f"internal error: {type(err).__name__}: {err}"))

    def _finish(self, job: Job, result: TurnResult) -> None:
        job.text(job.stop_text.flush())
        if job.stop_text.hit and result.finish_reason == "interrupted":
            # The request's stop string ended it (the ranks were stopped for it): the
            # reply is complete, as one the model ended itself.
            result = replace(result, finish_reason="stop")
        if self.record is not None:
            try:
                job.result = result
                self.record(job)
            except ExokvError as err:  # the store failed: the reply is still good
                print(f"exokv: warning: turn not recorded: {err}", file=sys.stderr, flush=True)
        job.done(result)

    def _run(self, job: Job) -> None:
        def on_text(piece: str) -> None:
            if job.cancelled.is_set() or job.stop_text.hit:
                self._stop(job)  # the stop may have come before the turn began
                return
            job.text(job.stop_text.stream(piece))
            if job.stop_text.hit:
                self._stop(job)

        def on_progress(done: int, total: int) -> None:
            if job.cancelled.is_set():
                self._stop(job)

        try:
            result = self.client.turn(job.request, on_text=on_text, on_progress=on_progress)
        except Exception as err:  # noqa: BLE001 - one request fails, the server stays up
            self._failed(job, err)
            return
        self._finish(job, result)


def _shutting_down() -> ApiError:
    """What a request the drain did not run, or could not end, is answered."""
    return ApiError(503, "the server is shutting down")


def _left_before_run(job: Job) -> bool:
    """Whether the job's client left while it waited (it is answered so): nothing ran."""
    if job.cancelled.is_set():
        job.fail(ApiError(499, "the client closed the request before it ran"))
    return job.finished


def _joinable(job: Job) -> bool:
    """Whether the job may run in a batch: a seeded sample is reproducible alone only."""
    return job.request.sample_seed is None or job.request.temp <= 0


def _too_long(job: Job, tokens: int, context: int) -> ApiError:
    field = job.prompt_field
    return ApiError(
        400,
        f"This model's maximum context length is {context:,} tokens; your "
        f"{field} {'are' if field.endswith('s') else 'is'} {tokens:,} tokens. Shorten "
        f"{'them' if field.endswith('s') else 'it'}.",
        param=field,
        code="context_length_exceeded",
    )
