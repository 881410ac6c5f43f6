"""`exokv serve` on one rank, through the real `openai` client: replies, usage, errors."""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path

import openai
import psutil
import pytest

from tests.chat_helpers import cache_json, chat_json, home_with_models, run_exokv
from tests.serve_helpers import MODEL, conversation_replies, raw, server_and_chat_homes, serving

pytestmark = pytest.mark.slow  # starts ranks, servers or real models: see tests/conftest.py

SYSTEM = "be brief"
TURNS = ["hello there", "tell me more about gardens"]


@pytest.fixture(scope="module")
def homes(tmp_path_factory: pytest.TempPathFactory, models_dir: Path) -> tuple[Path, Path]:
    return server_and_chat_homes(tmp_path_factory.mktemp("serve"), models_dir)


@pytest.fixture(scope="module")
def server(homes: tuple[Path, Path]):
    with serving(homes[0], "--max-tokens", "12") as s:
        yield s


@pytest.fixture(scope="module")
def chat_replies(homes: tuple[Path, Path]) -> list[dict]:
    return chat_json(TURNS, homes[1], "--system", SYSTEM)


def test_replies_equal_the_chats_and_the_second_call_is_served_from_the_cache(
    server, chat_replies
) -> None:
    done = conversation_replies(server, TURNS, SYSTEM, max_tokens=12)
    assert [d.choices[0].message.content for d in done] == [t["reply"] for t in chat_replies]
    first, second = (d.usage for d in done)
    assert first.prompt_tokens == chat_replies[0]["prompt_tokens"]
    assert second.prompt_tokens == chat_replies[1]["prompt_tokens"]
    # The second call resends the whole conversation: all of it but the new message is cached.
    assert second.prompt_tokens_details.cached_tokens == chat_replies[1]["cached_tokens"] > 0
    assert second.prompt_tokens_details.cached_tokens > first.prompt_tokens
    assert first.completion_tokens == chat_replies[0]["generated_tokens"]
    assert done[0].model == MODEL and done[0].object == "chat.completion"


def test_a_stream_gives_the_same_reply_and_usage_last(server, chat_replies) -> None:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TURNS[0]}]
    chunks = list(
        server.client().chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == chat_replies[0]["reply"]
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] in ("length", "stop") and set(finishes[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == len_prompt(chat_replies)
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0  # asked before, above
    # Without include_usage no usage chunk comes.
    plain = list(
        server.client().chat.completions.create(
            model=MODEL, messages=messages, max_tokens=3, temperature=0, stream=True
        )
    )
    assert all(c.choices for c in plain) and all(c.usage is None for c in plain)


def len_prompt(chat_replies: list[dict]) -> int:
    return chat_replies[0]["prompt_tokens"]


def test_models_and_health(server) -> None:
    listed = server.client().models.list()
    assert [m.id for m in listed.data] == [MODEL]
    status, _, doc = raw(server.url + "/health")
    assert status == 200 and doc["status"] == "ok" and doc["ranks"] == 1
    # Its one rank runs in a process of its own, not beside the event loop.
    children = psutil.Process(server.proc.pid).children(recursive=True)
    assert [p.environ().get("MLX_RANK") for p in children].count("0") == 1


@pytest.mark.parametrize(
    "body, says",
    [
        (b"{not json", "not valid JSON"),
        (b"[1, 2]", "JSON object"),
        (json.dumps({"messages": []}).encode(), "messages"),
        (json.dumps({"messages": [{"role": "robot", "content": "x"}]}).encode(), "role"),
        (json.dumps({"messages": [{"role": "assistant", "content": "x"}]}).encode(), "user"),
        (json.dumps({"messages": [{"role": "user", "content": 5}]}).encode(), "content"),
        (
            json.dumps(
                {"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}
            ).encode(),
            "temperature",
        ),
        (
            json.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}).encode(),
            "max_tokens",
        ),
        (
            json.dumps(
                {"messages": [{"role": "user", "content": "x"}], "max_tokens": 10**6}
            ).encode(),
            "max_tokens",
        ),
        (json.dumps({"messages": [{"role": "user", "content": "x"}], "n": 2}).encode(), "n"),
        (
            json.dumps({"messages": [{"role": "user", "content": "x"}], "stop": [""]}).encode(),
            "stop",
        ),
        (json.dumps({"messages": [{"role": "user", "content": "x"}] * 2000}).encode(), "messages"),
    ],
)
def test_bad_requests_are_400_in_openais_shape(server, body: bytes, says: str) -> None:
    status, _, doc = raw(server.base + "/chat/completions", body)
    assert status == 400, doc
    assert doc["error"]["type"] == "invalid_request_error" and says in doc["error"]["message"]


def test_a_prompt_over_the_context_is_400_naming_both_numbers(server) -> None:
    long_text = "word " * 40_000  # builtin:tiny's context is 32,768 tokens
    with pytest.raises(openai.BadRequestError) as caught:
        server.client().chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": long_text}], max_tokens=4
        )
    message = caught.value.body["message"]
    assert "32,768" in message and "80,0" in message, message
    assert caught.value.code == "context_length_exceeded"
    # The server goes on.
    assert conversation_replies(server, ["hi"], "", 3)[0].choices[0].message.content


def test_another_model_is_404_and_nothing_is_loaded(server) -> None:
    for name in ("builtin:small", "/etc/passwd", "../models/tiny"):
        with pytest.raises(openai.NotFoundError) as caught:
            server.client().chat.completions.create(
                model=name, messages=[{"role": "user", "content": "hi"}]
            )
        assert caught.value.code == "model_not_found" and "builtin:tiny" in str(caught.value)


def test_a_body_over_the_limit_is_413(server) -> None:
    body = json.dumps({"messages": [{"role": "user", "content": "x" * (2 << 20)}]}).encode()
    status, _, doc = raw(server.base + "/chat/completions", body)
    assert status == 413 and "1,000,000 bytes" in doc["error"]["message"]
    assert raw(server.url + "/nowhere")[0] == 404


def test_stop_strings_cut_the_reply(server, chat_replies) -> None:
    reply = chat_replies[0]["reply"]
    cut = reply[3:6]  # a piece of the reply at temperature 0
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TURNS[0]}]
    for stream in (False, True):
        made = server.client().chat.completions.create(
            model=MODEL, messages=messages, max_tokens=12, temperature=0, stop=[cut], stream=stream
        )
        if stream:
            chunks = [c for c in made if c.choices]
            text = "".join(c.choices[0].delta.content or "" for c in chunks)
            finish = chunks[-1].choices[0].finish_reason
        else:
            text, finish = made.choices[0].message.content, made.choices[0].finish_reason
        assert text == reply[: reply.index(cut)] and finish == "stop"


def test_a_seed_makes_sampling_repeatable(server) -> None:
    def sample(seed: int) -> str:
        return (
            server.client()
            .chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "roll"}],
                max_tokens=10,
                temperature=1.5,
                seed=seed,
                top_p=0.95,
            )
            .choices[0]
            .message.content
        )

    assert sample(7) == sample(7)
    assert len({sample(s) for s in (1, 2, 3)}) > 1


def test_a_client_that_leaves_mid_stream_stops_its_request(server, chat_replies) -> None:
    messages = [{"role": "user", "content": "a long story please"}]
    stream = server.client().chat.completions.create(
        model=MODEL, messages=messages, max_tokens=20_000, temperature=0, stream=True
    )
    for n, _chunk in enumerate(stream):
        if n == 3:
            break
    stream.close()
    line = server.wait_log(lambda x: " 499 " in x and "stream" in x)[-1]
    assert "finish=interrupted" in line, line
    assert int(line.split("completion=")[1].split()[0]) < 20_000
    # The next request on the same server is answered as if nothing had happened.
    again = conversation_replies(server, TURNS, SYSTEM, max_tokens=12)
    assert [d.choices[0].message.content for d in again] == [t["reply"] for t in chat_replies]


def test_each_request_has_an_access_log_line(server) -> None:
    conversation_replies(server, ["log me"], "", 4)
    line = server.wait_log(lambda x: "POST /v1/chat/completions 200" in x)[-1]
    for key in ("prompt=", "cached=", "completion=", "ttft=", "time="):
        assert key in line, line
    assert line[:4].isdigit()  # it starts with the time


def test_cache_commands_read_the_running_server(server) -> None:
    conversation_replies(server, ["inspect me", "and again"], "", 4)
    stats = cache_json(server.home, "stats")
    assert stats["runs"][0]["running"] and stats["ranks"][0]["hits"] >= 1, stats
    entries = cache_json(server.home, "entries")
    assert any(e["session"].startswith("api-") for e in entries["entries"]), entries
    assert cache_json(server.home, "pressure")["ranks"]


def test_queue_full_is_503_with_retry_after_a_key_is_required_and_no_speculate_holds(
    tmp_path: Path, models_dir: Path
) -> None:
    home = home_with_models(tmp_path / "h", models_dir, link=True)
    # One at a time: above --batch 1 the second request would join the running one.
    args = ("--queue", "1", "--batch", "1", "--api-key", "sekrit", "--no-speculate")
    with serving(home, *args) as s:
        for key in ("none", "wrong"):
            with pytest.raises(openai.AuthenticationError):
                s.client(key).models.list()
        status, _, doc = raw(s.base + "/chat/completions", b"{}")
        assert status == 401 and doc["error"]["type"] == "authentication_error"
        client = s.client("sekrit")
        long = {"model": MODEL, "max_tokens": 20_000, "temperature": 0}
        running = client.chat.completions.create(
            messages=[{"role": "user", "content": "one"}], stream=True, **long
        )
        next(iter(running))  # the first request runs
        waiting = threading.Thread(
            target=lambda: client.chat.completions.create(
                messages=[{"role": "user", "content": "two"}], max_tokens=2, model=MODEL
            )
        )
        waiting.start()
        deadline = time.monotonic() + 30
        while raw(s.url + "/health")[2]["waiting"] < 1 and time.monotonic() < deadline:
            time.sleep(0.05)  # until the second one waits in the queue
        with pytest.raises(openai.InternalServerError) as caught:
            client.chat.completions.create(messages=[{"role": "user", "content": "three"}], **long)
        assert caught.value.status_code == 503
        assert caught.value.response.headers["retry-after"] == "1"
        running.close()  # the first one leaves; the queued one runs
        waiting.join(timeout=60)
        assert not waiting.is_alive()
        answered = s.access(200)
        assert answered and all(" speculation=off " in x for x in answered), answered


@pytest.mark.parametrize(
    "sig, code, says",
    [
        (signal.SIGTERM, 0, "draining: 1 request in flight"),  # a clean drain exits 0
        (signal.SIGINT, 130, "interrupted"),
    ],
)
def test_sigterm_or_ctrl_c_drains_the_reply_in_flight_and_keeps_the_cache(
    tmp_path: Path, models_dir: Path, sig: int, code: int, says: str
) -> None:
    home = home_with_models(tmp_path / "h", models_dir, link=True)
    messages = [{"role": "user", "content": "remember this conversation"}]
    with serving(home) as s:
        stream = s.client().chat.completions.create(
            model=MODEL, messages=messages, max_tokens=300, temperature=0, stream=True
        )
        chunks = [next(iter(stream))]
        s.proc.send_signal(sig)
        chunks += list(stream)  # the reply in flight is finished, not cut
        assert chunks[-1].choices[0].finish_reason in ("length", "stop")
        assert s.proc.wait(timeout=90) == code
        assert any(says in x for x in s.log), s.log
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    # A new server on the same home finds the conversation in its disk tier.
    with serving(home) as again:
        done = again.client().chat.completions.create(
            model=MODEL,
            messages=messages
            + [{"role": "assistant", "content": text}, {"role": "user", "content": "go on"}],
            max_tokens=3,
            temperature=0,
        )
        assert done.usage.prompt_tokens_details.cached_tokens > 0


@pytest.mark.parametrize(
    "args, says",
    [
        (["--port", "70000"], "--port"),
        (["--queue", "0"], "--queue"),
        (["--batch-wait", "-1"], "--batch-wait"),
        (["--max-body", "lots"], "invalid size"),
        (["--parallel", "sideways"], "--parallel"),
    ],
)
def test_bad_server_options_are_one_line_and_exit_2(tmp_path: Path, args, says) -> None:
    proc = run_exokv(["serve", "--model", MODEL, *args], tmp_path, timeout=60)
    lines = proc.stderr.decode().strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and says in lines[0], lines
