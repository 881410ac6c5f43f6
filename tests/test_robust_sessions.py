"""Two chats and one session: a session is open in one chat at a time, and a turn is
appended to what is stored, never written over it (real chats, a real database)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from chat_helpers import home_with_models, run_exokv

from exokv.core.records import TurnResult
from exokv.state import Store


def _turn_rows(home: Path, session: str) -> int:
    with Store.open(home) as store, store.snapshot() as db:
        return db.execute(
            "SELECT COUNT(*) FROM turns t JOIN sessions s ON s.id = t.session_id WHERE s.name = ?",
            (session,),
        ).fetchone()[0]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_session_is_open_in_one_chat_at_a_time(tmp_path: Path, models_dir: Path) -> None:
    home = home_with_models(tmp_path / "h", models_dir)
    env = {**os.environ, "EXOKV_HOME": str(home)}
    env.pop("EXOKV_DEBUG", None)
    first = subprocess.Popen(
        [sys.executable, "-m", "exokv", "chat", "-m", "builtin:tiny", "--json"]
        + ["--max-tokens", "6", "--session", "s"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    assert first.stdin is not None and first.stdout is not None
    try:
        for n, line in enumerate(["one", "two"], start=1):
            first.stdin.write(f"{line}\n".encode())
            first.stdin.flush()
            assert json.loads(first.stdout.readline())["turn"] == n
        # A second chat on the same session, while the first is open: refused at once.
        tic = time.monotonic()
        second = run_exokv(
            ["chat", "-m", "builtin:tiny", "--json", "--session", "s"], home, "three\n"
        )
        lines = second.stderr.decode().strip().splitlines()
        assert second.returncode == 1 and len(lines) == 1, lines
        assert f"pid {first.pid}" in lines[0] and "'s'" in lines[0], lines
        assert time.monotonic() - tic < 30
        for n, line in enumerate(["four", "five"], start=3):
            first.stdin.write(f"{line}\n".encode())
            first.stdin.flush()
            assert json.loads(first.stdout.readline())["turn"] == n
        first.stdin.close()
        assert first.wait(60) == 0
    finally:
        if first.poll() is None:
            first.kill()
    # Once the first chat has ended, the session is free; /retry and /undo still work.
    after = run_exokv(
        ["chat", "-m", "builtin:tiny", "--json", "--max-tokens", "6", "--session", "s"],
        home,
        "six\n/retry\nseven\n/undo\n",
    )
    assert after.returncode == 0, after.stderr.decode()
    with Store.open(home) as store:
        users = [m["content"] for m in store.load_messages("s") if m["role"] == "user"]
    assert users == ["one", "two", "four", "five", "six"]
    assert _turn_rows(home, "s") == 7  # four, then six, its retry and seven


def test_a_turn_from_an_out_of_date_copy_is_appended(tmp_path: Path) -> None:
    # Two writers of one session, each with its own copy (what two chats used to be):
    # every turn of both is kept, in the order they were recorded.
    result = TurnResult("s", "", 1, 0, 1, 1, 0.1, 10.0, 0.0, 1)
    with Store.open(tmp_path) as store:
        run = store.start_run("m", 1, [None])
        a: list[dict[str, str]] = []
        b: list[dict[str, str]] = []
        for i in range(3):
            for name, copy in (("a", a), ("b", b)):
                copy += [
                    {"role": "user", "content": f"{name}{i}"},
                    {"role": "assistant", "content": f"reply {name}{i}"},
                ]
                store.record_turn(run, "s", copy, result, "m")
        users = [m["content"] for m in store.load_messages("s") if m["role"] == "user"]
        assert users == ["a0", "b0", "a1", "b1", "a2", "b2"]
        # /retry: the same conversation with its last reply replaced replaces only that.
        current = store.load_messages("s")
        store.record_turn(
            run, "s", [*current[:-1], {"role": "assistant", "content": "new"}], result, "m"
        )
        again = store.load_messages("s")
        assert again[:-1] == current[:-1] and again[-1]["content"] == "new"
