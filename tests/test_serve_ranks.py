"""`exokv serve -n 2`: the same API over two pipeline ranks, through the `openai` client."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import openai
import pytest

from tests.chat_helpers import chat_json, home_with_models
from tests.serve_helpers import MODEL, raw, server_and_chat_homes, serving

pytestmark = pytest.mark.slow  # starts ranks, servers or real models: see tests/conftest.py

SYSTEM = "be brief"
TURNS = ["hello there", "tell me more about gardens"]
KEY = "two-ranks"


@pytest.fixture(scope="module")
def homes(tmp_path_factory: pytest.TempPathFactory, models_dir: Path) -> tuple[Path, Path]:
    return server_and_chat_homes(tmp_path_factory.mktemp("serve-ranks"), models_dir)


@pytest.fixture(scope="module")
def server(homes: tuple[Path, Path]):
    # One at a time: above --batch 1 a second request would join the running one, and
    # the queue-full test needs it to wait.
    args = ["-n", "2", "--starting-port", "26700", "--queue", "1", "--batch", "1"]
    args += ["--api-key", KEY]
    with serving(homes[0], *args) as s:
        yield s


@pytest.fixture(scope="module")
def one_rank_chat(homes: tuple[Path, Path]) -> list[dict]:
    return chat_json(TURNS, homes[1], "--system", SYSTEM)


def ask(server, messages: list[dict], **kw):
    return server.client(KEY).chat.completions.create(
        model=MODEL, messages=messages, temperature=0, **kw
    )


def test_two_ranks_answer_as_the_one_rank_chat_and_cache_the_conversation(
    server, one_rank_chat
) -> None:
    messages = [{"role": "system", "content": SYSTEM}]
    replies, usages = [], []
    for n, text in enumerate(TURNS):
        messages.append({"role": "user", "content": text})
        if n == 0:
            done = ask(server, messages, max_tokens=12)
            reply, used = done.choices[0].message.content, done.usage
        else:
            chunks = list(
                ask(
                    server,
                    messages,
                    max_tokens=12,
                    stream=True,
                    stream_options={"include_usage": True},
                )
            )
            reply = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            used = chunks[-1].usage
        replies.append(reply)
        usages.append(used)
        messages.append({"role": "assistant", "content": reply})
    assert replies == [t["reply"] for t in one_rank_chat]
    assert usages[1].prompt_tokens_details.cached_tokens == one_rank_chat[1]["cached_tokens"] > 0
    status, _, doc = raw(server.url + "/health")
    assert status == 200 and doc["ranks"] == 2


def test_errors_on_two_ranks(server) -> None:
    with pytest.raises(openai.AuthenticationError):
        server.client("wrong").models.list()
    with pytest.raises(openai.NotFoundError):
        server.client(KEY).chat.completions.create(
            model="other", messages=[{"role": "user", "content": "hi"}]
        )
    # Refused by the ranks (every rank alike, before any collective): a 400 naming both.
    with pytest.raises(openai.BadRequestError) as caught:
        ask(server, [{"role": "user", "content": "word " * 40_000}], max_tokens=4)
    assert "32,768" in caught.value.body["message"] and "80,0" in caught.value.body["message"]
    assert ask(server, [{"role": "user", "content": "still here"}], max_tokens=3).choices


def test_a_client_leaving_mid_stream_stops_both_ranks_and_the_next_is_right(
    server, one_rank_chat
) -> None:
    stream = ask(
        server, [{"role": "user", "content": "a long story"}], max_tokens=20_000, stream=True
    )
    for n, _chunk in enumerate(stream):
        if n == 3:
            break
    # While it runs, the queue (one place) fills: the next is a 503 with Retry-After.
    waiting = threading.Thread(
        target=lambda: ask(server, [{"role": "user", "content": "queued"}], max_tokens=2)
    )
    waiting.start()
    deadline = time.monotonic() + 30
    while raw(server.url + "/health")[2]["waiting"] < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    with pytest.raises(openai.InternalServerError) as caught:
        ask(server, [{"role": "user", "content": "one too many"}], max_tokens=2)
    assert caught.value.status_code == 503 and caught.value.response.headers["retry-after"]
    stream.close()
    line = server.wait_log(lambda x: " 499 " in x and "stream" in x)[-1]
    assert "finish=interrupted" in line and int(line.split("completion=")[1].split()[0]) < 20_000
    waiting.join(timeout=60)
    assert not waiting.is_alive()
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TURNS[0]}]
    assert (
        ask(server, messages, max_tokens=12).choices[0].message.content == one_rank_chat[0]["reply"]
    )


def test_with_no_restarts_a_rank_that_dies_ends_the_server_with_one_line(
    tmp_path: Path, models_dir: Path
) -> None:
    import psutil

    home = home_with_models(tmp_path / "h", models_dir, link=True)
    with serving(home, "-n", "2", "--starting-port", "26740", "--restarts", "0") as s:
        assert ask_plain(s, "hello").choices
        ranks = [
            p
            for p in psutil.Process(s.proc.pid).children(recursive=True)
            if p.environ().get("MLX_RANK") == "1"
        ]
        assert len(ranks) == 1
        ranks[0].kill()
        assert s.proc.wait(timeout=60) == 1  # not a server that answers nothing
        errors = [x for x in s.log if x.startswith("exokv: error:")]
        assert len(errors) == 1 and "rank 1" in errors[0], s.log


def ask_plain(server, text: str):
    return server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=3
    )
