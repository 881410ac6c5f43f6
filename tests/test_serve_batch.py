"""`exokv serve --batch N`: concurrent requests decoded together, with the real openai client.

Eight requests arrive while a first one runs and join its batch at a decode step
(the access log says batch= on each, and on the first one's line: it started alone).
Their replies equal the one-at-a-time replies, each rank stays within its budget after
every request, and a client that leaves mid-stream stops its own row only. On two
ranks the front end is made to lag (it takes 0.3 s over each message of text from
rank 0): the leaver's row still stops within a few decode steps of the text it was
shown, because rank 0 never runs far ahead of the front end and the stop is sent the
moment the client leaves (exokv.rank.textflow).
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from exokv.config import TEST_SLOW_TEXTS
from exokv.core.sizes import parse_size
from exokv.rank.textflow import WINDOW
from exokv.state.connection import db_path
from tests.chat_helpers import home_with_models
from tests.serve_helpers import MODEL, raw, serving

pytestmark = pytest.mark.slow  # starts ranks, servers or real models: see tests/conftest.py

SYSTEM = "You are the shared assistant of the batch test; answer every client briefly."
MAX_TOKENS = [6, 12, 3, 9, 16, 5, 10, 8]
LEAVER = 3  # this client streams a long reply and leaves after a few pieces
BUDGET = "64KB"
LAG_S = 0.3  # on two ranks, the front end's time over each message of text


def messages(client: int) -> list[dict[str, str]]:
    line = f"client {client} asks about topic {client * 7 % 11}" + " please" * (client % 3)
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": line}]


def ask(api, client: int) -> str:
    """Client `client`'s reply: odd clients stream it, even ones take it whole."""
    if client % 2:
        stream = api.chat.completions.create(
            model=MODEL,
            messages=messages(client),
            max_tokens=MAX_TOKENS[client],
            temperature=0,
            stream=True,
        )
        return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    done = api.chat.completions.create(
        model=MODEL, messages=messages(client), max_tokens=MAX_TOKENS[client], temperature=0
    )
    return done.choices[0].message.content


def leave_mid_stream(api, pieces: int = 3) -> int:
    """Stream a 30000-token reply and leave after `pieces` pieces; how many came."""
    stream = api.chat.completions.create(
        model=MODEL, messages=messages(LEAVER), max_tokens=30000, temperature=0, stream=True
    )
    got = 0
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            got += 1
            if got == pieces:
                break
    stream.close()
    return got


@pytest.fixture(scope="module")
def one_at_a_time(tmp_path_factory: pytest.TempPathFactory, models_dir: Path) -> list[str]:
    home = home_with_models(tmp_path_factory.mktemp("batch-ref") / "h", models_dir, link=True)
    with serving(home, "--batch", "1") as s:  # one request at a time
        api = s.client()
        return [ask(api, c) for c in range(len(MAX_TOKENS))]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("ranks", [1, 2])
def test_requests_that_arrive_during_a_batch_join_it_and_reply_as_one_at_a_time(
    tmp_path: Path, models_dir: Path, one_at_a_time: list[str], ranks: int
) -> None:
    home = home_with_models(tmp_path / "h", models_dir, link=True)
    args = ["--batch", "9", "--queue", "16", "--cache-budget", BUDGET]
    env = {}
    if ranks == 2:
        args += ["-n", "2", "--starting-port", "26870"]
        env[TEST_SLOW_TEXTS.name] = str(LAG_S)
    with serving(home, *args, env=env) as s:
        # A first request holds the ranks (some seconds) and runs alone (a batch of one)
        # until the eight arrive: they join it at a decode step, not after it. With the
        # front end's lag, the ranks make about 30 tokens a second.
        hold = 2000 if ranks == 1 else 300
        apis = [s.client() for _ in MAX_TOKENS]  # made before: the eight come at once
        with ThreadPoolExecutor(len(MAX_TOKENS) + 1) as pool:
            blocker = pool.submit(
                lambda: s.client().chat.completions.create(
                    model=MODEL, messages=messages(99), max_tokens=hold, temperature=0
                )
            )
            deadline = time.monotonic() + 60
            while not raw(s.url + "/health")[2]["busy"]:
                assert time.monotonic() < deadline, "the first request did not start"
                time.sleep(0.05)
            clients = [c for c in range(len(MAX_TOKENS)) if c != LEAVER]
            replies = {c: pool.submit(ask, apis[c], c) for c in clients}
            left = pool.submit(leave_mid_stream, apis[LEAVER])
            assert left.result(timeout=300) == 3
            got = {c: f.result(timeout=300) for c, f in replies.items()}
            blocker.result(timeout=300)
        assert got == {c: one_at_a_time[c] for c in clients}
        assert s.proc.poll() is None and raw(s.url + "/health")[2]["status"] == "ok"
        # The access log: the first, which began alone, decoded with rows that joined it
        # (on a loaded machine a late one may find its batch ended and run after it).
        # The leaver stopped early.
        done = s.wait_log(lambda x: " /v1/" in x and " 200 " in x, count=len(clients) + 1)
        assert len(done) == len(clients) + 1, s.access()
        assert sum("batch=" in x for x in done) >= 2, s.access()
        gone = s.wait_log(lambda x: " /v1/" in x and " 499 " in x and "batch=" in x)
        assert len(gone) == 1 and "finish=interrupted" in gone[0], s.access()
        completion = int(gone[0].split("completion=")[1].split()[0])
        if ranks == 1:
            assert 3 <= completion < 30000
        else:
            # Each of the 3 pieces it read holds at most WINDOW + 1 steps' text; the
            # front end may hand on a message or two more before it sees the client
            # leave; rank 0 is at most WINDOW steps past that. Without the flow control
            # rank 0 ran free at a few ms a step: hundreds of tokens by then.
            assert 3 <= completion <= 6 * (WINDOW + 1), s.access(499)
        # A later request still runs, and is served from the cache the batch left.
        again = apis[0].chat.completions.create(
            model=MODEL, messages=messages(0), max_tokens=MAX_TOKENS[0], temperature=0
        )
        assert again.choices[0].message.content == one_at_a_time[0]
        assert again.usage.prompt_tokens_details.cached_tokens > 0
    budget = parse_size(BUDGET)
    with sqlite3.connect(db_path(home)) as db:
        samples = db.execute(
            "SELECT rank, cache_bytes FROM memory_samples WHERE run_id = (SELECT MAX(id) FROM runs)"
        ).fetchall()
    assert {r for r, _ in samples} == set(range(ranks))
    assert len(samples) >= ranks * (len(MAX_TOKENS) + 1)  # one per rank after each request
    over = [(r, b) for r, b in samples if b > budget]
    assert not over, over


@pytest.mark.timeout(300)
def test_a_lone_stream_that_leaves_stops_within_a_few_steps_on_two_ranks(
    tmp_path: Path, models_dir: Path
) -> None:
    """One request at a time (--batch 1), the front end lagging: the turn's text is paced
    as a batch's, so the leaver's turn ends a few steps past what it was shown."""
    home = home_with_models(tmp_path / "h", models_dir, link=True)
    args = ["-n", "2", "--starting-port", "26880", "--batch", "1"]
    with serving(home, *args, env={TEST_SLOW_TEXTS.name: "1.0"}) as s:  # 1 s over each message
        assert leave_mid_stream(s.client()) == 3
        gone = s.wait_log(lambda x: " /v1/" in x and " 499 " in x, timeout=120)
        completion = int(gone[0].split("completion=")[1].split()[0])
        # Each piece read holds at most WINDOW + 1 tokens, and the ranks agree on a stop
        # every few tokens. A message per token, read 1 s apart, let rank 0 run hundreds
        # of tokens ahead (80 with 0.3 s).
        assert "finish=interrupted" in gone[0] and 3 <= completion <= 6 * (WINDOW + 1), gone


def test_batch_must_be_at_least_one(tmp_path: Path, models_dir: Path) -> None:
    home = home_with_models(tmp_path / "h", models_dir, link=True)
    run = subprocess.run(
        [sys.executable, "-m", "exokv", "serve", "--model", MODEL, "--batch", "0"],
        env={**os.environ, "EXOKV_HOME": str(home)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2
    assert "--batch 0: at least 1" in run.stderr
    assert "Traceback" not in run.stderr
