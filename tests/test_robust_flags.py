"""The edges of every flag, a prompt over the model's context, a damaged page, Ctrl-C:
each a one-line message before anything runs that should not."""

from __future__ import annotations

import io
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from chat_helpers import exokv_text, home_with_models, run_exokv
from rich.console import Console

from exokv.chat.render import BannerInfo, Renderer

pytestmark = pytest.mark.slow  # starts ranks, servers or real models: see tests/conftest.py


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory, models_dir: Path) -> Path:
    return home_with_models(tmp_path_factory.mktemp("flags") / "h", models_dir, link=True)


BAD_FLAGS = [
    (["--temp", "nan"], "--temp nan"),
    (["--temp", "inf"], "--temp inf"),
    (["--seed", "-1"], "--seed -1"),
    (["--seed", str(2**64)], "--seed"),
    (["--cache-budget", "99999999999999999999GB"], "larger than 9223372036854775807"),
    (["--max-kv-size", str(2**63)], "--max-kv-size"),
    (["--max-tokens", str(2**63)], "--max-tokens"),
    (["--split", "2,2"], "--split spreads layers over ranks"),
    (["-n", "5", "--starting-port", "28310"], "the model has 4 layers"),
    (["-n", "3", "--parallel", "tensor"], "2 KV heads do not divide among 3 ranks"),
    (["-n", "100000"], "memory to start about"),
    (["--max-tokens", "abc"], "Invalid value for '--max-tokens'"),
    (["--no-such-flag"], "No such option: --no-such-flag"),
]

# Every case in one python process (each one exits through exokv's own main, as the
# command does): the usage errors need no fresh interpreter, and the suite stays fast.
_RUN_CASES = """
import contextlib, io, json, sys
from exokv.cli.app import main
out = []
for args in json.loads(sys.argv[1]):
    err = io.StringIO()
    sys.argv = ["exokv", "chat", "-m", "builtin:tiny", *args]
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()) as so:
        try:
            main()
            code = 0
        except SystemExit as exit:
            code = exit.code
    out.append([code, err.getvalue(), so.getvalue()])
print(json.dumps(out))
"""


def test_a_bad_flag_is_one_usage_line_before_anything_starts(home: Path) -> None:
    env = {**os.environ, "EXOKV_HOME": str(home)}
    env.pop("EXOKV_DEBUG", None)
    tic = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", _RUN_CASES, json.dumps([a for a, _ in BAD_FLAGS])],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    for (args, says), (code, err, out) in zip(BAD_FLAGS, json.loads(proc.stdout), strict=True):
        lines = err.strip().splitlines()
        assert code == 2, (args, err)
        assert len(lines) == 1 and lines[0].startswith("exokv: error:"), (args, err)
        assert says in lines[0], (args, lines[0])
        assert out == "", args  # no turn ran
    assert time.monotonic() - tic < 60  # refused before any rank was started


@pytest.mark.timeout(120)
def test_a_prompt_over_the_context_is_refused_before_prefill(home: Path) -> None:
    # builtin:tiny's context is 32,768 tokens; this line is about 80,000.
    long_line = "word " * 40_000
    tic = time.monotonic()
    proc = run_exokv(
        ["chat", "-m", "builtin:tiny", "--json", "--max-tokens", "4", "--session", "long"]
        + ["-n", "2", "--starting-port", "28320"],
        home,
        f"hi\n{long_line}\n",
    )
    elapsed = time.monotonic() - tic
    err = proc.stderr.decode()
    lines = err.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1, err
    assert "32,768" in lines[0] and "the prompt is 80," in lines[0] and "shorten" in lines[0]
    assert elapsed < 60  # not a prefill of 80,000 tokens
    docs = [json.loads(x) for x in proc.stdout.decode().splitlines()]
    assert [d["turn"] for d in docs] == [1]
    from exokv.state import Store

    with Store.open(home) as store:  # the finished turn is kept, the refused one is not
        assert [m["content"] for m in store.load_messages("long")][0] == "hi"
        assert len(store.load_messages("long")) == 2


def test_a_cache_budget_of_zero_keeps_no_cache(home: Path) -> None:
    proc = run_exokv(
        ["chat", "-m", "builtin:tiny", "--json", "--max-tokens", "4", "--cache-budget", "0"],
        home,
        "hello\nand again\n",
    )
    assert proc.returncode == 0, proc.stderr.decode()
    turns = [json.loads(x) for x in proc.stdout.decode().splitlines()]
    assert [t["cached_tokens"] for t in turns] == [0, 0]
    assert all(t["cache_bytes"] == [0] for t in turns)
    out = io.StringIO()
    Renderer(console=Console(file=out, width=200)).banner(
        BannerInfo(model="builtin:tiny", ranks=1, budgets=[0], session="s")
    )
    assert "no prefix cache kept (--cache-budget 0)" in out.getvalue()


def _damage_a_page(db: Path) -> str:
    """Overwrite the end of one b-tree page (cells then run off it); SQLite's verdict."""
    original = db.read_bytes()
    size = int.from_bytes(original[16:18], "big")
    for start in range(len(original) - size, size - 1, -size):  # the last pages hold rows
        if original[start] not in (0x0D, 0x05):  # a table leaf or interior page
            continue
        data = bytearray(original)
        data[start + size - 48 : start + size] = bytes(range(48))
        db.write_bytes(bytes(data))
        with sqlite3.connect(db) as conn:
            try:
                verdict = conn.execute("PRAGMA quick_check(1)").fetchone()[0]
            except sqlite3.DatabaseError:
                verdict = "ok"
        if verdict != "ok":
            return verdict
    raise AssertionError("no page of the database could be damaged")


def test_a_damaged_page_is_one_line(tmp_path: Path, models_dir: Path) -> None:
    home = home_with_models(tmp_path / "h", models_dir, link=True)
    proc = run_exokv(["chat", "-m", "builtin:tiny", "--json", "--max-tokens", "4"], home, "a\nb\n")
    assert proc.returncode == 0, proc.stderr.decode()
    verdict = _damage_a_page(home / "exokv.db")
    assert "\n" in verdict  # SQLite's own report of a damaged page spans lines
    proc = exokv_text(home, "cache", "stats")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr
    assert "cannot be used" in lines[0] and "mv " in lines[0]


@pytest.mark.timeout(120)
def test_ctrl_c_in_script_mode_says_interrupted(home: Path) -> None:
    env = {**os.environ, "EXOKV_HOME": str(home)}
    env.pop("EXOKV_DEBUG", None)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "exokv",
            "chat",
            "-m",
            "builtin:tiny",
            "--json",
            "--max-tokens",
            "4",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(b"hello\n")
    proc.stdin.flush()
    assert json.loads(proc.stdout.readline())["turn"] == 1
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert err.decode() == "exokv: interrupted\n"
