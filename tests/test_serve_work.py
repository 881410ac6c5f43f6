"""The serve queue's worker (exokv.serve.work.TurnQueue) with a client that only records
which requests it was given together: no model, no ranks."""

from __future__ import annotations

import asyncio
import threading
import time

from exokv.core.records import NO_CALLS, BatchCalls, RowOutcome, TurnRequest, TurnResult
from exokv.serve.rows import default_batch
from exokv.serve.work import Job, TurnQueue
from tests.stub_client import StubClient


def _result(request: TurnRequest) -> TurnResult:
    return TurnResult(
        session=request.session,
        reply="ok",
        prompt_tokens=1,
        cached_tokens=0,
        prefilled_tokens=1,
        generated_tokens=1,
        ttft_s=0.0,
        decode_tps=0.0,
        overhead_s=0.0,
        ranks=1,
    )


class RecordingClient(StubClient):
    """Answers at once; `calls` lists the sessions of each turn or batch it was given."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []

    def turn(self, request: TurnRequest, **_: object) -> TurnResult:
        self.calls.append([request.session])
        return _result(request)

    def turns(self, requests: list[TurnRequest], calls: object = None) -> list[RowOutcome]:
        self.calls.append([r.session for r in requests])
        return [RowOutcome(result=_result(r), batch=len(requests)) for r in requests]


def _submit_apart(queue: TurnQueue, names: list[str], gap_s: float) -> list[Job]:
    loop = asyncio.new_event_loop()  # never run: the jobs' events just queue up on it
    jobs = []
    for name in names:
        job = Job(TurnRequest(session=name, messages=[]), [], loop)
        jobs.append(job)
        queue.submit(job)
        time.sleep(gap_s)
    return jobs


def _finished(jobs: list[Job]) -> bool:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if all(j.finished for j in jobs):
            return True
        time.sleep(0.01)
    return False


def test_requests_sent_a_few_ms_apart_are_decoded_together() -> None:
    client = RecordingClient()
    queue = TurnQueue(client, size=8, batch=8, gather_s=1.0)
    try:
        jobs = _submit_apart(queue, ["a", "b", "c"], gap_s=0.02)
        assert _finished(jobs)
    finally:
        queue.close(timeout=5)
    assert client.calls == [["a", "b", "c"]]
    assert [j.batch for j in jobs] == [3, 3, 3]


def test_a_full_batch_does_not_wait_out_the_window() -> None:
    client = RecordingClient()
    queue = TurnQueue(client, size=8, batch=2, gather_s=30.0)
    try:
        jobs = _submit_apart(queue, ["a", "b"], gap_s=0.0)
        assert _finished(jobs)  # within 10 s, not the 30 s window
    finally:
        queue.close(timeout=5)
    assert client.calls == [["a", "b"]]


class JoiningClient(RecordingClient):
    """Its batch waits for `release`, then takes the requests that join it (as the ranks
    do at a decode step) and answers every row; `calls` has the batch's sessions."""

    def __init__(self) -> None:
        super().__init__()
        self.started = threading.Event()
        self.release = threading.Event()

    def turns(self, requests: list[TurnRequest], calls: BatchCalls = NO_CALLS) -> list[RowOutcome]:
        self.started.set()
        self.release.wait(10)  # the others arrive while it runs
        joins = calls.joins
        joined = joins() if callable(joins) else []
        rows = list(requests) + joined
        self.calls.append([r.session for r in rows])
        return [RowOutcome(result=_result(r), batch=len(rows)) for r in rows]


def test_requests_that_arrive_during_a_batch_join_it() -> None:
    client = JoiningClient()
    queue = TurnQueue(client, size=8, batch=8, gather_s=0.0)
    try:
        jobs = _submit_apart(queue, ["a"], gap_s=0.0)
        assert client.started.wait(10)  # a lone request runs as a batch: others may join
        jobs += _submit_apart(queue, ["b", "c"], gap_s=0.0)
        client.release.set()
        assert _finished(jobs)
    finally:
        queue.close(timeout=5)
    assert client.calls == [["a", "b", "c"]]
    assert [j.batch for j in jobs] == [3, 3, 3]


def test_joins_fill_the_batch_up_to_its_size_and_a_seeded_sample_runs_alone_after() -> None:
    client = JoiningClient()
    alone: list[str] = []

    def turn(request: TurnRequest, **_: object) -> TurnResult:
        alone.append(request.session)
        return _result(request)

    client.turn = turn  # type: ignore[method-assign]
    queue = TurnQueue(client, size=8, batch=2, gather_s=0.0)
    try:
        jobs = _submit_apart(queue, ["a"], gap_s=0.0)
        assert client.started.wait(10)
        loop = asyncio.new_event_loop()
        seeded = Job(TurnRequest(session="s", messages=[], temp=0.7, sample_seed=3), [], loop)
        queue.submit(seeded)
        jobs += _submit_apart(queue, ["b", "c"], gap_s=0.0)
        client.release.set()
        assert _finished([*jobs, seeded])
    finally:
        queue.close(timeout=5)
    # "b" fills the batch of 2; "c" waits for the next one; the seeded job runs alone.
    assert client.calls[0] == ["a", "b"]
    assert alone == ["s"]
    assert ["c"] in client.calls[1:]


def test_with_batch_1_a_request_runs_alone_and_later_ones_wait() -> None:
    client = RecordingClient()
    queue = TurnQueue(client, size=8, batch=1)
    try:
        jobs = _submit_apart(queue, ["a", "b"], gap_s=0.0)
        assert _finished(jobs)
    finally:
        queue.close(timeout=5)
    assert client.calls == [["a"], ["b"]]


def test_the_worker_frees_its_thread_state_before_close_returns() -> None:
    # A one-rank server's worker runs the model: MLX's state for that thread must be
    # freed by the thread itself, before it ends (an exit racing it aborted the server).
    client = RecordingClient()
    released: list[str] = []
    client.release_thread = lambda: released.append(threading.current_thread().name)  # type: ignore[method-assign]
    queue = TurnQueue(client, size=8, batch=1)
    jobs = _submit_apart(queue, ["a"], gap_s=0.0)
    assert _finished(jobs)
    assert released == []
    queue.close(timeout=5)
    assert released == ["exokv-serve-turns"]


def test_past_the_old_eight_every_newcomer_joins_the_running_batch() -> None:
    """With the default batch (memory for 32 rows or more) eight running rows do not
    make the next eight wait for them: all join the batch in flight at its next step."""
    client = JoiningClient()
    batch = default_batch([20 << 30], [3072], None, 256, queue=64)
    queue = TurnQueue(client, size=64, batch=batch, gather_s=0.0)
    first = [f"a{i}" for i in range(8)]
    later = [f"b{i}" for i in range(8)]
    try:
        jobs = _submit_apart(queue, first[:1], gap_s=0.0)
        assert client.started.wait(10)
        jobs += _submit_apart(queue, first[1:] + later, gap_s=0.0)
        client.release.set()
        assert _finished(jobs)
    finally:
        queue.close(timeout=5)
    assert batch >= 32
    assert client.calls == [first + later]
    assert {j.batch for j in jobs} == {16}


class DeafClient(RecordingClient):
    """A batch whose rows never hear a stop: the ranks' end of a stop that was lost."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.stops: list[int] = []

    def turns(self, requests: list[TurnRequest], calls: object = None) -> list[RowOutcome]:
        self.calls.append([r.session for r in requests])
        self.release.wait(timeout=60)
        return [RowOutcome(result=_result(r), batch=len(requests)) for r in requests]

    def stop_row(self, row: int) -> None:
        self.stops.append(row)


def test_a_stop_that_never_lands_fails_the_open_requests_within_the_bound() -> None:
    client = DeafClient()
    queue = TurnQueue(client, size=8, batch=4, gather_s=1.0)  # both in one batch
    queue.stopped_within_s = 0.5
    jobs = _submit_apart(queue, ["a", "b"], gap_s=0.0)
    deadline = time.monotonic() + 10
    while client.calls != [["a", "b"]] and time.monotonic() < deadline:
        time.sleep(0.01)
    started = time.monotonic()
    try:
        queue.close(timeout=0.0)
        assert time.monotonic() - started < 5  # not the 60 s the batch would take
        assert client.stops == [0, 1]  # each row was asked to stop first
        for job in jobs:
            assert job.finished
            kind, error = job.loop.run_until_complete(job.events.get())
            assert (kind, error.status) == ("error", 503), (kind, error)
        queue.stopped_within_s = 30  # the server's end closes again: the first bound holds
        again = time.monotonic()
        queue.close(timeout=0.0)
        assert time.monotonic() - again < 5
    finally:
        client.release.set()
