"""Bad input: one line on stderr, the documented exit code, never a traceback or a hang."""

from __future__ import annotations

import json

import pytest
from chat_helpers import run_exokv

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]  # slow: starts ranks (tests/conftest.py)


def _one_line_error(proc) -> str:
    err = proc.stderr.decode()
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines, "an error must say what went wrong"
    return err


@pytest.mark.parametrize(
    ("args", "code", "words"),
    [
        (["--model", "builtin:nope"], 2, "builtin"),
        (["--model", "/no/such/model/dir"], 2, "not found"),
        (["--model", "nobody/no-such-model-xyz"], 1, "not found"),
        (["--model", "builtin:tiny", "--cache-budget", "lots"], 2, "size"),
        (["--model", "builtin:tiny", "--cache-budget", "1MB,2MB"], 2, "ranks"),
        (["--model", "builtin:tiny", "--max-tokens", "-3"], 2, "max-tokens"),
        (["--model", "builtin:tiny", "--memory-threshold", "1.5"], 2, "threshold"),
        (["--model", "builtin:tiny", "--parallel", "diagonal"], 2, "parallel"),
    ],
)
def test_bad_flags(tmp_path, args, code, words):
    proc = run_exokv(["chat", *args], tmp_path, "hello\n")
    assert proc.returncode == code, proc.stderr.decode()
    assert words in _one_line_error(proc).lower()


def test_empty_long_and_invalid_utf8_lines(tmp_path):
    long_line = ("word " * 2000)[:10_000]
    stdin = b"\n   \n" + long_line.encode() + b"\n" + b"caf\xe9 \xff\xfe ok\n"
    proc = run_exokv(
        ["chat", "--model", "builtin:tiny", "--json", "--max-tokens", "4"], tmp_path, stdin
    )
    assert proc.returncode == 0, proc.stderr.decode()
    turns = [json.loads(line) for line in proc.stdout.decode().splitlines()]
    assert len(turns) == 2, "blank lines are skipped; the long and the bad line are turns"
    assert turns[0]["prompt_tokens"] > 1000
    assert "not valid UTF-8" in proc.stderr.decode()
    assert "Traceback" not in proc.stderr.decode()


def test_unknown_slash_command_is_reported_and_chat_goes_on(tmp_path):
    proc = run_exokv(
        ["chat", "--model", "builtin:tiny", "--max-tokens", "4"], tmp_path, "/frobnicate\nhi\n"
    )
    assert proc.returncode == 0
    assert "unknown command /frobnicate" in proc.stderr.decode()
    assert proc.stdout.strip(), "the turn after the bad command still runs"


def test_default_model_is_announced(tmp_path):
    proc = run_exokv(
        ["chat", "--max-tokens", "2"], tmp_path, "/quit\n", env={"EXOKV_MODEL": "builtin:tiny"}
    )
    assert proc.returncode == 0, proc.stderr.decode()
    assert "builtin:tiny" in proc.stderr.decode() and "--model" in proc.stderr.decode()


@pytest.mark.parametrize(
    "args", [["chat", "--bogus"], ["nope"], ["cache", "evictions", "--limit", "abc"]]
)
def test_usage_errors_exit_2_without_traceback(tmp_path, args):
    proc = run_exokv(args, tmp_path)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr.decode()
