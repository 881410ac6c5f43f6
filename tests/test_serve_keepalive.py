"""A long prefill behind `exokv serve`'s stream: keep-alive comments while it runs, and
a client that leaves during it stops the turn. The app and its queue run in this
process, over a client whose 'prefill' is a loop of steps (no model)."""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections.abc import Callable

import pytest

from exokv.core.records import TurnRequest, TurnResult
from exokv.serve import app as app_module
from tests.serve_helpers import InProcess
from tests.stub_client import StubClient

pytestmark = pytest.mark.slow  # starts ranks, servers or real models: see tests/conftest.py

STEP_S = 0.05


class SlowPrefill(StubClient):
    """A turn whose prefill takes `steps` steps, each told to on_progress (where the
    server checks for a stop, as the engine does between prefill chunks)."""

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self.stopped = threading.Event()
        self.ran = threading.Event()

    def stop_now(self) -> None:
        self.stopped.set()

    def turn(
        self,
        request: TurnRequest,
        on_text: Callable[[str], None] | None = None,
        on_progress: Callable[[int, int], None] | None = None,
    ) -> TurnResult:
        self.ran.set()
        done, finish = 0, "length"
        for done in range(1, self.steps + 1):
            time.sleep(STEP_S)
            if self.stopped.is_set():
                finish = "interrupted"
                break
            if on_progress is not None:
                on_progress(done, self.steps)
        else:
            if on_text is not None:
                on_text("done")
        return TurnResult(
            session=request.session,
            reply="done" if finish == "length" else "",
            prompt_tokens=self.steps,
            cached_tokens=0,
            prefilled_tokens=done,
            generated_tokens=1 if finish == "length" else 0,
            ttft_s=0.0,
            decode_tps=0.0,
            overhead_s=0.0,
            ranks=1,
            finish_reason=finish,
        )


@pytest.fixture
def serve(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(app_module, "HEAD_WAIT_S", 0.1)
    monkeypatch.setattr(app_module, "KEEPALIVE_S", 0.1)
    servers = InProcess()
    log: list[str] = []

    def start(client: SlowPrefill) -> int:
        return servers.start(client, log=log.append)

    yield start, log
    servers.close()


def _open_stream(port: int) -> http.client.HTTPResponse:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    body = {"messages": [{"role": "user", "content": "long"}], "stream": True}
    conn.request("POST", "/v1/chat/completions", json.dumps(body))
    return conn.getresponse()


@pytest.mark.timeout(60)
def test_a_long_prefill_is_streamed_with_keep_alive_comments(serve) -> None:
    start, _ = serve
    port = start(SlowPrefill(steps=30))  # 1.5 s of prefill, keep-alives every 0.1 s
    resp = _open_stream(port)
    assert resp.status == 200  # the headers came before the prefill ended
    lines = [x.decode().strip() for x in resp if x.strip()]
    first_text = next(i for i, x in enumerate(lines) if '"content": "done"' in x)
    assert lines[:first_text].count(": keep-alive") >= 3
    assert lines[-1] == "data: [DONE]"


@pytest.mark.timeout(60)
def test_a_client_that_leaves_during_the_prefill_stops_it_at_the_next_step(serve) -> None:
    start, log = serve
    client = SlowPrefill(steps=400)  # 20 s if nobody stopped it
    port = start(client)
    resp = _open_stream(port)
    assert resp.readline().startswith(b"data: ")  # the stream began
    assert resp.readline().strip() == b""
    assert resp.readline().strip() == b": keep-alive"
    resp.close()  # the client leaves during the prefill
    assert client.stopped.wait(timeout=10)
    deadline = time.monotonic() + 10
    while not any(" 499 " in x for x in log) and time.monotonic() < deadline:
        time.sleep(0.05)
    (line,) = [x for x in log if " 499 " in x]
    assert "finish=interrupted" in line and line.endswith("stream")  # not run to its end
    assert "completion=0" in line  # stopped in the prefill
