"""`exokv serve` stopped and started again as a user of a server sees it: SIGTERM past
the drain limit ends every stream with its last chunk, a restarted server answers a
resent conversation as an uninterrupted one, /health says when a rank is down."""

from __future__ import annotations

import http.client
import json
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.chat_helpers import home_with_models
from tests.serve_helpers import MODEL, Server, raw, serving

pytestmark = pytest.mark.slow  # starts ranks, servers or real models: see tests/conftest.py

TRACEBACKS = ("Traceback", "Exception in", "Event loop is closed", "Task was destroyed")
TURNS = ["hello there", "tell me more about gardens", "and about the sea"]


def _sse_lines(url: str, body: dict, decoding: threading.Event | None = None) -> list[str]:
    """The data lines of a stream, read to its end (the body's end, however it came);
    `decoding` is set once a chunk carries generated text."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "x"})
    resp = conn.getresponse()
    assert resp.status == 200
    lines = []
    for raw_line in resp:
        line = raw_line.decode().strip()
        if not line.startswith("data: "):
            continue
        lines.append(line.removeprefix("data: "))
        if decoding is not None and lines[-1] != "[DONE]":
            choices = json.loads(lines[-1]).get("choices") or [{}]
            if choices[0].get("delta", {}).get("content"):
                decoding.set()
    return lines


@pytest.mark.timeout(300)
@pytest.mark.parametrize("ranks", [["-n", "1"], ["-n", "2", "--starting-port", "26890"]])
def test_sigterm_past_the_drain_limit_ends_every_stream_with_a_final_chunk(
    tmp_path: Path, models_dir: Path, ranks: list[str]
) -> None:
    home = home_with_models(tmp_path / "h", models_dir, link=True)
    body = {
        "messages": [{"role": "user", "content": "a very long story"}],
        "max_tokens": 20000,
        # Greedy: at temperature 1 builtin:tiny's random weights write the end token
        # within 500-2,700 tokens, so on a loaded machine a reply could end by itself
        # before the drain stops it; greedy ran 6,000 tokens without one.
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with serving(home, "--drain-timeout", "1", *ranks) as s:
        got: list[list[str]] = []
        decoding = threading.Event()
        reader = threading.Thread(target=lambda: got.append(_sse_lines(s.url, body, decoding)))
        reader.start()
        # The real client sees the error event as an error, not as a normal end.
        stream = s.client().chat.completions.create(
            model=MODEL, messages=body["messages"], max_tokens=20000, temperature=0, stream=True
        )
        chunks = iter(stream)
        first = next(chunks)
        assert first.choices[0].delta.role == "assistant"
        # SIGTERM once both decode, so both are rows of one batch when the drain stops them
        # (on a loaded machine the second may still be prefilling at the first's role chunk).
        while not next(chunks).choices[0].delta.content:
            pass
        assert decoding.wait(timeout=120)
        s.proc.send_signal(signal.SIGTERM)
        with pytest.raises(openai.APIError, match="shut"):
            for _ in chunks:
                pass
        reader.join(timeout=120)
        assert s.proc.wait(timeout=60) == 128 + signal.SIGTERM  # the drain had to stop them
    lines = got[0]
    assert lines[-1] == "[DONE]"
    error, finish, used = (json.loads(x) for x in lines[-4:-1])
    assert error.get("error", {}).get("code") == "shutting_down", (lines[-6:], s.log)
    assert finish["choices"][0]["finish_reason"] == "length"
    assert 0 < used["usage"]["completion_tokens"] < 20000
    assert any(x.startswith("exokv: draining: 2 requests in flight") for x in s.log), s.log
    # One line each, both stopped on the ranks: the second joined the first's batch.
    stopped = [x for x in s.access(503) if x.endswith("stream")]
    assert len(stopped) == 2, s.log
    assert all("finish=interrupted" in x and "batch=2" in x for x in stopped), s.log
    assert not [x for x in s.log if any(t in x for t in TRACEBACKS)], s.log


def _conversation(server, turns: list[str]) -> list:
    client = server.client()
    messages: list[dict[str, str]] = [{"role": "system", "content": "be brief"}]
    out = []
    for text in turns:
        messages.append({"role": "user", "content": text})
        done = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=24, temperature=0
        )
        out.append(done)
        messages.append({"role": "assistant", "content": done.choices[0].message.content})
    return out


def _resend(server, earlier: list, turns: list[str]):
    """The last turn of `turns` sent with the replies `earlier` gave the others."""
    messages: list[dict[str, str]] = [{"role": "system", "content": "be brief"}]
    for text, done in zip(turns, earlier, strict=False):
        messages += [
            {"role": "user", "content": text},
            {"role": "assistant", "content": done.choices[0].message.content},
        ]
    messages.append({"role": "user", "content": turns[-1]})
    return server.client().chat.completions.create(
        model=MODEL, messages=messages, max_tokens=24, temperature=0
    )


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory, models_dir: Path) -> list:
    """TURNS on one server that is never stopped, one rank: the reference of both rank
    counts below (at temperature 0 two pipeline ranks reply and cache as one does), so
    one server start, not one per case."""
    whole = home_with_models(tmp_path_factory.mktemp("whole") / "h", models_dir, link=True)
    with serving(whole, "-n", "1") as s:
        return _conversation(s, TURNS)


@pytest.mark.timeout(420)
@pytest.mark.parametrize("ranks", ["1", "2"])
def test_a_restarted_server_answers_a_resent_conversation_as_an_uninterrupted_one(
    tmp_path: Path, models_dir: Path, ranks: str, uninterrupted: list
) -> None:
    args = ["-n", ranks, "--starting-port", "26810" if ranks == "2" else "0"]
    args = args if ranks == "2" else ["-n", "1"]
    cut = home_with_models(tmp_path / "cut", models_dir, link=True)
    with serving(cut, *args) as s:
        before = _conversation(s, TURNS[:2])
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(timeout=90) == 0  # a clean drain
    assert [d.choices[0].message.content for d in before] == [
        d.choices[0].message.content for d in uninterrupted[:2]
    ]
    with serving(cut, *args) as again:
        after = _resend(again, before, TURNS)
    want = uninterrupted[-1]
    assert after.choices[0].message.content == want.choices[0].message.content
    assert after.usage.prompt_tokens == want.usage.prompt_tokens
    assert after.usage.prompt_tokens_details.cached_tokens == (
        want.usage.prompt_tokens_details.cached_tokens
    )


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory, models_dir: Path) -> Iterator[Server]:
    """One two-rank server for the health test and the long-prefill test (one set of
    ranks, not two); its prefill slowed for the latter (seconds of prefill, in steps)."""
    home = home_with_models(tmp_path_factory.mktemp("two") / "h", models_dir, link=True)
    slow = {"EXOKV_TEST_SLOW_PREFILL": "0.004"}
    with serving(home, "-n", "2", "--starting-port", "26850", env=slow) as s:
        yield s


@pytest.mark.timeout(300)
def test_health_says_a_rank_is_down_and_the_ranks_start_again_without_a_request(
    two_ranks: Server,
) -> None:
    import psutil

    s = two_ranks
    asked = len(s.access())  # the other test's requests, if it ran first
    status, _, doc = raw(s.url + "/health")
    assert (status, doc["status"]) == (200, "ok")
    ranks = [
        p
        for p in psutil.Process(s.proc.pid).children(recursive=True)
        if p.environ().get("MLX_RANK") == "1"
    ]
    assert len(ranks) == 1
    ranks[0].kill()
    seen = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        status, _, doc = raw(s.url + "/health")
        seen.append((status, doc["status"]))
        if seen[-1] == (200, "ok") and len(seen) > 1 and seen[-2] != (200, "ok"):
            break
        time.sleep(0.1)
    assert (503, "degraded") in seen, seen
    assert seen[-1] == (200, "ok"), seen
    # Started again by the watch, with no request: the log says so.
    s.wait_log(lambda x: "starting the ranks again" in x)
    assert s.access()[asked:] == []  # no request was sent
    done = s.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    assert done.choices[0].message.content


@pytest.mark.timeout(400)
def test_a_client_that_leaves_during_a_long_prefill_stops_it_on_every_rank(
    two_ranks: Server,
) -> None:
    long = " ".join(f"word{i}" for i in range(300))  # some 1,400 tokens
    body = {"messages": [{"role": "user", "content": long}], "max_tokens": 5, "stream": True}
    s = two_ranks  # its prefill slowed by EXOKV_TEST_SLOW_PREFILL
    host, port = s.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "x"})
    resp = conn.getresponse()
    assert resp.status == 200  # the headers did not wait for the prefill
    assert resp.readline().startswith(b"data: ")  # the role chunk; no token yet
    conn.close()  # the client leaves during the prefill
    (line,) = s.wait_log(lambda x: " 499 " in x, timeout=300)
    assert "finish=interrupted" in line and "completion=0" in line, line
    # What the ranks prefilled before the stop is cached, alike on both (a mismatch
    # would fail this prefill): a part of the prompt, not all of it.
    again = s.client().chat.completions.create(model=MODEL, messages=body["messages"], max_tokens=1)
    prompt, cached = again.usage.prompt_tokens, again.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < prompt - 1, (cached, prompt)  # stopped in the prefill, not after
