"""Every table at 80 and 60 columns: nothing wider, and no name or number cut with `…`.

One scripted chat with a small budget (so entries are evicted) fills a home; then
`exokv cache stats|entries|pressure|evictions`, `exokv sessions list` and the chat's
`/stats`, `/evictions` and `/sessions` tables are rendered at each width.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from chat_helpers import home_with_models, run_exokv
from rich.console import Console

from exokv.chat.conversation import Outcome
from exokv.chat.render import Renderer
from exokv.core import tables
from exokv.core.sizes import format_size

pytestmark = pytest.mark.timeout(240)

LONG = "a-rather-long-session-name-about-pasta"
WIDTHS = [80, 60]
CACHE_COMMANDS = ["stats", "entries", "pressure", "evictions"]


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory, models_dir: Path) -> Path:
    path = home_with_models(tmp_path_factory.mktemp("width") / "home", models_dir, link=True)
    lines = [
        "/new paris",
        "Hello there, tell me about the weather in Paris today",
        "And what about tomorrow in London?",
        f"/new {LONG}",
        "A completely different question about cooking pasta with fresh tomatoes",
        "How long should I boil it, and should the water be salted?",
        "/switch paris",
        "One more thing about Paris: is it sunny in the spring?",
    ]
    args = ["--cache-budget", "60KB", "--disk-budget", "0", "--max-tokens", "8"]
    proc = run_exokv(
        ["chat", "--model", "builtin:tiny", "--json", *args], path, "\n".join(lines) + "\n"
    )
    assert proc.returncode == 0, proc.stderr.decode()
    return path


def _run(home: Path, width: int, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "EXOKV_HOME": str(home), "COLUMNS": str(width)}
    env.pop("EXOKV_DEBUG", None)
    return subprocess.run(
        [sys.executable, "-m", "exokv", *args],
        capture_output=True,
        text=True,
        env=env,
        stdin=subprocess.DEVNULL,
        timeout=60,
    )


def _assert_fits(text: str, width: int, must_show: list[str]) -> None:
    assert "…" not in text, f"a cell was cut:\n{text}"
    for line in text.splitlines():
        assert len(line.rstrip()) <= width, f"wider than {width}: {line!r}"
    for value in must_show:
        whole = re.compile(r"(?<!\S)" + re.escape(value) + r"(?!\S)")
        assert whole.search(text), f"{value!r} is not shown whole:\n{text}"


def _json(home: Path, *args: str) -> dict:
    proc = _run(home, 200, *args, "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.slow
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("command", CACHE_COMMANDS)
def test_cache_tables_fit(home: Path, command: str, width: int) -> None:
    proc = _run(home, width, "cache", command)
    assert proc.returncode == 0, proc.stderr
    if command == "stats":
        doc = _json(home, "cache", "stats")
        r = doc["ranks"][0]
        must = [str(r["cached_tokens"]), format_size(r["bytes"]), str(r["hits"])]
    elif command == "entries":
        rows = _json(home, "cache", "entries")["entries"]
        must = [e["session"] for e in rows] + [str(e["tokens"]) for e in rows]
    elif command == "pressure":
        r = _json(home, "cache", "pressure")["ranks"][0]
        must = ["0", format_size(r["cache_bytes"])]
    else:
        rows = _json(home, "cache", "evictions")["evictions"]
        assert rows, "the fixture's budget should have evicted entries"
        must = [e["session"] for e in rows] + [format_size(e["bytes"][0]) for e in rows]
    _assert_fits(proc.stdout, width, must)


@pytest.mark.slow
@pytest.mark.parametrize("width", WIDTHS)
def test_sessions_list_fits(home: Path, width: int) -> None:
    proc = _run(home, width, "sessions", "list")
    assert proc.returncode == 0, proc.stderr
    _assert_fits(proc.stdout, width, ["paris", LONG])


def _render(width: int, outcome: Outcome) -> str:
    out = io.StringIO()
    Renderer(Console(file=out, width=width), Console(file=out, width=width)).outcome(outcome)
    return out.getvalue()


@pytest.mark.slow
@pytest.mark.parametrize("width", WIDTHS)
def test_chat_tables_fit(home: Path, width: int) -> None:
    from exokv.chat.conversation import ChatController, TurnSettings
    from exokv.frontend.hooks import StoreHooks
    from exokv.state import Store

    with Store.open(home) as store:
        run = store.stats()["runs"][0]["id"]
        hooks = StoreHooks(store, run, "builtin:tiny")
        chat = ChatController(object(), TurnSettings(), "paris", hooks=hooks)  # type: ignore[arg-type]
        stats = chat.command("/stats")
        evictions = chat.command("/evictions")
        sessions = chat.command("/sessions")
    rank = stats.data[0]
    _assert_fits(_render(width, stats), width, [format_size(rank["bytes"]), str(rank["hits"])])
    names = [e["session"] for e in evictions.data]
    _assert_fits(_render(width, evictions), width, names)
    _assert_fits(_render(width, sessions), width, ["paris", LONG])


def test_narrower_still_stacks_rather_than_cuts() -> None:
    cols = [tables.Column("Session", "left"), tables.Column("Tokens")]
    rows = [[LONG, "1,234"]]
    out = io.StringIO()
    Console(file=out, width=40).print(tables.fit(cols, rows, 40))
    text = out.getvalue()
    _assert_fits(text, 40, [LONG, "1,234"])


def test_compact_sizes_and_times() -> None:
    assert [format_size(n) for n in (512, 4_100, 557_100, 22_700_000_000)] == [
        "512 B",
        "4.1 KB",
        "557 KB",
        "23 GB",
    ]
    assert tables.when("2026-11-29T20:53:07+00:00").count(":") >= 1
    assert len(tables.when("2020-01-01T20:53:07+00:00")) == 10  # another year: the date


@pytest.mark.slow
def test_script_mode_prints_human_tables(home: Path, tmp_path: Path) -> None:
    home = Path(shutil.copytree(home, tmp_path / "copy", symlinks=True))  # a run of its own
    proc = run_exokv(["chat", "--model", "builtin:tiny", "--session", "paris"], home,
                     "/stats\n/sessions\n/evictions\n")  # fmt: skip
    assert proc.returncode == 0, proc.stderr.decode()
    out = proc.stdout.decode()
    assert not out.lstrip().startswith(("[", "{"))
    assert "Rank" in out and "Session" in out and LONG in out and "Reason" in out
