"""After a scripted chat with evictions, `exokv cache ...` agrees with the chat's own
per-turn `--json` objects: tokens, hits, evictions, entries, bytes and pressure."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from chat_helpers import cache_json, exokv_text

pytestmark = pytest.mark.slow  # starts ranks, servers or real models: see tests/conftest.py

BUDGET = 200_000
CHAT = ["chat", "--model", "builtin:tiny", "--json", "--cache-budget", "200KB", "--max-tokens", "8"]
CHAT += ["--disk-budget", "0"]  # evictions, not spills: what the tables are checked on
LINES = [
    "Hello there, tell me about the weather in Paris today",
    "And what about tomorrow in London?",
    "/new other",
    "A completely different question about cooking pasta with fresh tomatoes",
    "How long should I boil it, and should the water be salted?",
    "/switch {first}",
    "One more thing about Paris: is it sunny in the spring?",
    "/new third",
    "Write a short poem about the sea, the wind and the gulls",
    "Now make it rhyme, please, and keep it under four lines",
    "/switch other",
    "And what sauce goes best with it?",
]


def replay(turns: list[dict]) -> dict[int, tuple[int, list[int]]]:
    """The live entries the chat's own events imply: id -> (tokens, bytes per rank)."""
    live: dict[int, tuple[int, list[int]]] = {}
    for t in turns:
        for e in t["events"]:
            if e["kind"] in ("add", "update"):
                live[e["entry"]] = (e["tokens"], e["bytes"])
            elif e["kind"] == "evict":
                live.pop(e["entry"], None)
            elif e["kind"] == "clear":
                live.clear()
    return live


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    home = tmp_path_factory.mktemp("home")
    # The first session gets a generated name; name it so /switch can come back to it.
    lines = ["/new first"] + [line.format(first="first") for line in LINES]
    proc = exokv_text(home, *CHAT, stdin="\n".join(lines) + "\n/quit\n", timeout=600)
    assert proc.returncode == 0, proc.stderr
    objects = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    turns = [o for o in objects if "prompt_tokens" in o]
    assert len(turns) == sum(1 for line in lines if not line.startswith("/"))
    assert sum(t["evictions"] for t in turns) > 0, "the budget must force evictions"
    return home, turns


def test_stats_agree_with_the_turns(chat_run: tuple[Path, list[dict]]) -> None:
    home, turns = chat_run
    stats = cache_json(home, "stats")
    assert len(stats["runs"]) == 1 and stats["runs"][0]["running"] is False
    assert stats["runs"][0]["ranks"] == turns[-1]["ranks"]
    total = stats["total"]
    hits = sum(1 for t in turns if t["cached_tokens"] > 0)
    assert total["turns"] == len(turns)
    assert (total["hits"], total["misses"]) == (hits, len(turns) - hits)
    assert total["tokens_saved"] == sum(t["cached_tokens"] for t in turns)
    assert total["prompt_tokens"] == sum(t["prompt_tokens"] for t in turns)
    assert total["prefilled_tokens"] == sum(t["prefilled_tokens"] for t in turns)
    assert total["evictions"] == sum(t["evictions"] for t in turns)
    last = {s["rank"]: s for s in turns[-1]["rank_stats"]}
    for row in stats["ranks"]:
        assert row["budget"] == BUDGET
        assert row["bytes"] == last[row["rank"]]["cache_bytes"], row
        assert row["entries"] == last[row["rank"]]["entries"], row
        assert row["pressure"] == last[row["rank"]]["pressure"]


def test_entries_agree_with_the_events(chat_run: tuple[Path, list[dict]]) -> None:
    home, turns = chat_run
    entries = cache_json(home, "entries")["entries"]
    live = replay(turns)
    assert {e["id"]: e["tokens"] for e in entries} == {k: v[0] for k, v in live.items()}
    assert {e["id"]: e["bytes"] for e in entries} == {k: v[1] for k, v in live.items()}
    stats = cache_json(home, "stats")
    for row in stats["ranks"]:
        assert row["bytes"] == sum(e["bytes"][row["rank"]] for e in entries)
    assert stats["total"]["cached_tokens"] == sum(e["tokens"] for e in entries)
    by_session = cache_json(home, "entries", "--session", "other")["entries"]
    assert by_session == [e for e in entries if e["session"] == "other"]


def test_evictions_agree_with_the_events(chat_run: tuple[Path, list[dict]]) -> None:
    home, turns = chat_run
    keys = ("decision", "entry", "session", "tokens", "bytes", "reason", "pressures")
    want = [
        (t["session"], t["turn"], *(e[k] for k in keys))
        for t in turns
        for e in t["events"]
        if e["kind"] == "evict"
    ]
    log = cache_json(home, "evictions", "--limit", "1000")["evictions"]
    got = [
        (e["turn_session"], e["turn"], *(e[k] for k in keys)) for e in reversed(log)
    ]  # the log is newest first
    assert got == want
    assert all(e["freed"] == sum(e["bytes"]) for e in log)
    ranked = cache_json(home, "evictions", "--rank", "0", "--limit", "1000")["evictions"]
    assert [e["freed"] for e in ranked] == [e["bytes"][0] for e in log]


def test_pressure_agrees_with_the_rank_stats(chat_run: tuple[Path, list[dict]]) -> None:
    home, turns = chat_run
    ranks = cache_json(home, "pressure", "--history", "1000")["ranks"]
    assert [r["rank"] for r in ranks] == list(range(turns[-1]["ranks"]))
    for row in ranks:
        series = [t["rank_stats"][row["rank"]] for t in turns]
        assert row["pressure"] == series[-1]["pressure"]
        assert row["cache_bytes"] == series[-1]["cache_bytes"]
        assert row["budget"] == BUDGET
        assert [h["pressure"] for h in row["history"]] == [s["pressure"] for s in series]
        assert [h["cache_bytes"] for h in row["history"]] == [s["cache_bytes"] for s in series]


def test_tables_render_after_the_chat(chat_run: tuple[Path, list[dict]]) -> None:
    home, _ = chat_run
    for command in ("stats", "entries", "pressure", "evictions"):
        proc = exokv_text(home, "cache", command)
        assert proc.returncode == 0 and proc.stdout.strip(), proc.stderr


def test_readers_see_whole_turns_while_a_chat_writes(tmp_path: Path) -> None:
    topics = ["the sea", "bread", "trains", "owls", "glass", "rain", "chess", "copper"]
    lines = [f"Tell me one fact about {topics[i % 8]}, number {i}." for i in range(20)]
    (tmp_path / "in.txt").write_text("\n".join(lines) + "\n")
    env = {**os.environ, "EXOKV_HOME": str(tmp_path / "home")}
    command = [sys.executable, "-c", "from exokv.cli.app import main; main()"]
    chat_args = [*CHAT[:-1], "24"]  # longer replies: the chat writes for a few seconds
    with (tmp_path / "in.txt").open() as stdin, (tmp_path / "out.txt").open("w") as stdout:
        chat = subprocess.Popen(
            [*command, *chat_args], stdin=stdin, stdout=stdout, stderr=subprocess.PIPE, env=env
        )
        reads: list[dict] = []
        failures: list[str] = []

        def poll() -> None:
            while chat.poll() is None:
                proc = exokv_text(tmp_path / "home", "cache", "stats", "--json")
                if proc.returncode != 0 or proc.stderr:
                    failures.append(f"exit {proc.returncode}: {proc.stderr.strip()}")
                    return
                reads.append(json.loads(proc.stdout)["total"])

        pollers = [threading.Thread(target=poll) for _ in range(2)]
        for p in pollers:
            p.start()
        _, err = chat.communicate(timeout=600)
        for p in pollers:
            p.join(120)
    assert chat.returncode == 0, err.decode()
    assert not failures, failures[:3]
    turns = [json.loads(line) for line in (tmp_path / "out.txt").read_text().splitlines()]
    turns = [t for t in turns if "prompt_tokens" in t]
    assert len(turns) == len(lines)
    for total in reads:
        n = total["turns"]
        done = turns[:n]
        assert total["tokens_saved"] == sum(t["cached_tokens"] for t in done), total
        assert total["prompt_tokens"] == sum(t["prompt_tokens"] for t in done), total
        assert total["evictions"] == sum(t["evictions"] for t in done), total
        assert total["hits"] + total["misses"] == n
    assert any(0 < r["turns"] < len(turns) for r in reads), "no read overlapped the chat"
