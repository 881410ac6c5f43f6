"""A stream's pieces that wait in its queue go out as one chunk (exokv.serve.app)."""

from __future__ import annotations

import asyncio

from exokv.core.records import TurnRequest
from exokv.serve import app
from exokv.serve.work import Job


def job_with(events: list[tuple[str, object]]) -> Job:
    loop = asyncio.new_event_loop()
    job = Job(TurnRequest(session="s", messages=[], max_tokens=4), [], loop)
    for event in events:
        job.events.put_nowait(event)
    loop.close()
    return job


def test_the_pieces_queued_behind_a_piece_are_joined_up_to_the_first_other_event() -> None:
    job = job_with([("text", "b"), ("text", "c"), ("done", "result"), ("text", "late")])
    assert app._queued_texts(job, "a") == ("abc", ("done", "result"))
    assert job.events.get_nowait() == ("text", "late")  # left for the next read
    assert job.events.empty()


def test_a_piece_with_nothing_queued_goes_out_alone() -> None:
    job = job_with([])
    assert app._queued_texts(job, "a") == ("a", None)
    job = job_with([("text", "b")])
    assert app._queued_texts(job, "a") == ("ab", None) and job.events.empty()
