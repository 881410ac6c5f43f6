"""Connections held to bounds (exokv.serve.connections): clients that never send, send
half a request, or open too many, are closed and said in a bounded number of lines,
while /health still answers."""

from __future__ import annotations

import logging
import resource
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from exokv.serve import app as app_module
from exokv.serve.connections import (
    Guard,
    Notices,
    RateLimited,
    default_max_connections,
    guarded_protocol,
    hold_logs_to_pace,
)
from tests.serve_helpers import free_port
from tests.stub_client import StubClient


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Later:
    """A loop's call_later, run by hand."""

    def __init__(self) -> None:
        self.calls: list[tuple[float, Any, tuple[Any, ...]]] = []

    def call_later(self, delay: float, fn: Any, *args: Any) -> None:
        self.calls.append((delay, fn, args))

    def run(self) -> None:
        calls, self.calls = self.calls, []
        for _, fn, args in calls:
            fn(*args)


def test_notices_say_a_cause_once_per_interval_with_the_count_since() -> None:
    lines: list[str] = []
    clock, loop = Clock(), Later()
    notices = Notices(lines.append, every_s=10.0, clock=clock)

    def line(n: int, peer: str) -> str:
        return f"{n} from {peer}"

    notices.note("head", line, "a:1", loop)
    for i in range(500):
        notices.note("head", line, f"b:{i}", loop)
    notices.note("idle", line, "c:1", loop)
    assert lines == ["1 from a:1", "1 from c:1"]
    assert len(loop.calls) == 1 and loop.calls[0][0] == pytest.approx(10.0)
    clock.now += 10
    loop.run()  # the burst is said when its interval has passed, nothing following it
    assert lines[-1] == "500 from b:499"
    loop.run()
    assert len(lines) == 3


def test_a_guard_words_each_cause() -> None:
    lines: list[str] = []
    guard = Guard(Notices(lines.append), head_s=10, body_s=65, max_connections=1024)
    guard.closed("head", "1.2.3.4:5", None)
    guard.closed("idle", "1.2.3.4:6", None)
    assert lines == [
        "closed 1 connection that sent no request head within 10 s (the last: 1.2.3.4:5)",
        "closed 1 connection idle the longest, to keep at most 1,024 open (the last: 1.2.3.4:6)",
    ]


def test_the_cap_and_a_pass_of_accepts_fit_in_the_file_limit(monkeypatch) -> None:
    for soft, cap in ((2048, 960), (256, 64), (100_000, 1024), (100, 16)):
        monkeypatch.setattr(resource, "getrlimit", lambda _, soft=soft: (soft, soft))
        assert default_max_connections() == cap


def test_repeated_warnings_are_one_line_per_interval_without_tracebacks() -> None:
    clock = Clock()
    limit = RateLimited(every_s=10.0, clock=clock)
    logger = logging.getLogger("test.rate_limited")

    def record(msg: str, error: BaseException | None = None) -> logging.LogRecord:
        exc_info = (type(error), error, None) if error else None
        return logger.makeRecord(logger.name, logging.ERROR, __file__, 1, msg, None, exc_info)

    error = OSError(24, "Too many open files")
    first = record("socket.accept() out of system resource\nsocket: <socket ...>", error)
    assert limit.filter(first)
    assert first.getMessage() == (
        "socket.accept() out of system resource: OSError: [Errno 24] Too many open files"
    )
    assert first.exc_info is None
    assert not limit.filter(record("socket.accept() out of system resource", error))
    assert limit.filter(record("Invalid HTTP request received."))  # a cause of its own
    assert not limit.filter(record("Invalid HTTP request received."))
    clock.now += 11
    again = record("socket.accept() out of system resource", error)
    assert limit.filter(again)
    assert "(1 more like it in the last 11 s not logged)" in again.getMessage()
    kept = RateLimited(tracebacks=True)  # EXOKV_DEBUG=1
    traced = record("socket.accept() out of system resource", error)
    assert kept.filter(traced) and traced.exc_info is not None


# -- a server in this process, idle and half-sent connections against it ---------------


@pytest.fixture
def guarded(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[int, list[str], list[str]]]:
    """The app (no ranks) under uvicorn with the guard's protocol: heads within 0.5 s,
    bodies within 1.5 s (the app's own 408 at 0.8 s), at most 20 connections."""
    import uvicorn

    from exokv.serve.app import Service, build_app
    from exokv.serve.work import TurnQueue

    monkeypatch.setattr(app_module, "BODY_TIMEOUT_S", 0.8)
    said: list[str] = []
    access: list[str] = []
    queue = TurnQueue(StubClient(), 4)
    service = Service(model="m", names={"m"}, queue=queue, ranks=1, log=access.append)
    guard = Guard(Notices(said.append, every_s=1.0), head_s=0.5, body_s=1.5, max_connections=20)
    port = free_port()
    config = uvicorn.Config(
        build_app(service),
        port=port,
        log_level="warning",
        lifespan="off",
        http=guarded_protocol(guard),
    )
    hold_logs_to_pace()
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    try:
        yield port, said, access
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        queue.close(timeout=1)


def _closed(sock: socket.socket, within: float) -> bool:
    sock.settimeout(within)
    try:
        return sock.recv(1) == b""
    except OSError:
        return True  # reset: closed too


def _until_closed(sock: socket.socket, within: float) -> bytes:
    """What `sock` receives until the server closes it (AssertionError after `within`)."""
    sock.settimeout(within)
    chunks = []
    while chunk := sock.recv(4096):
        chunks.append(chunk)
    return b"".join(chunks)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_idle_and_half_sent_connections_are_closed_and_health_answers(guarded) -> None:
    port, said, access = guarded
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(50)]
    half = socket.create_connection(("127.0.0.1", port))
    head = b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nContent-Length: 500\r\n\r\n"
    half.sendall(head + b'{"messages": [')
    try:
        # 51 connections against a cap of 20: the idle ones made room, /health got in.
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as resp:
            assert resp.status == 200
        answer = _until_closed(half, 5)  # the 408, then the connection's end
        assert answer.startswith(b"HTTP/1.1 408 ")
        assert b'"type":"error"' in answer and b"did not arrive within 0.8 s" in answer
        assert all(_closed(s, 3) for s in idle)
        time.sleep(1.2)  # a burst's count is said when its interval has passed
    finally:
        for s in [*idle, half]:
            s.close()
    assert any(" POST /v1/messages 408 " in line for line in access)
    assert 2 <= len(said) <= 6, said  # per cause at most one line a second, here
    closed = sum(int(line.split()[1]) for line in said)
    assert closed == 50, said
    assert any("idle the longest, to keep at most 20 open" in line for line in said)
    assert any("sent no request head within 0.5 s" in line for line in said)
