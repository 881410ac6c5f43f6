"""Starting ranks in a terminal: progress on stderr, Ctrl-C that leaves nothing behind, and
ranks on one machine sharing its memory for their default budgets."""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import psutil
import pytest
from chat_helpers import Terminal, home_with_models
from test_repl import exokv_env, prompt

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]  # slow: starts ranks (tests/conftest.py)

SIZE = {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12}


def _bytes(text: str) -> float:
    number, unit = text.split()
    return float(number) * SIZE[unit]


def _processes_of(home: Path) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("EXOKV_HOME") == str(home):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def test_two_ranks_show_progress_and_share_the_default_budget(
    tmp_path: Path, models_dir: Path
) -> None:
    home = home_with_models(tmp_path / "home", models_dir, link=True)
    cmd = [sys.executable, "-m", "exokv", "chat", "--model", "builtin:tiny", "--session", "r"]
    one = Terminal(cmd, exokv_env(home))
    try:
        alone = one.expect(r"1 rank · cache budget ([\d.]+ [KMGT]?B)")
        one.expect(prompt("r"))
        one.type("\x04")
    finally:
        assert one.close() == 0
    term = Terminal([*cmd, "-n", "2", "--starting-port", "28500"], exokv_env(home))
    try:
        start = term.expect(r"starting 2 ranks…").end()
        term.expect(r"ready in [\d.]+ s", 120)
        shared = term.expect(r"cache budgets r0 ([\d.]+ [KMGT]?B), r1 ([\d.]+ [KMGT]?B)")
        # Both ranks' progress is shown; the launcher relays their lines in its own time,
        # so the last one may come just after "ready".
        loaded = set(re.findall(r"rank (\d) loaded its part of the model", term.text[start:]))
        term.expect(prompt("r"))
        term.type("\x04")
        term.expect("bye")
    finally:
        code = term.close(60)
    assert code == 0, term.text[-2000:]
    assert loaded == {"0", "1"}
    machine = _bytes(alone.group(1))
    for budget in (shared.group(1), shared.group(2)):
        assert _bytes(budget) < 0.6 * machine, (budget, alone.group(1))


def test_ctrl_c_while_ranks_start_leaves_no_process(tmp_path: Path, models_dir: Path) -> None:
    home = home_with_models(tmp_path / "home", models_dir, link=True)
    cmd = [sys.executable, "-m", "exokv", "chat", "--model", "builtin:tiny", "-n", "2"]
    term = Terminal([*cmd, "--starting-port", "28510"], exokv_env(home))
    try:
        term.expect(r"starting 2 ranks…")
        time.sleep(0.5)
        term.type("\x03")
        term.expect(r"exokv: interrupted")
    finally:
        code = term.close(60)
    assert code == 130, term.text[-2000:]
    deadline = time.monotonic() + 20
    while (left := _processes_of(home)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, [p.cmdline() for p in left]
    assert not re.search(r"Traceback", term.text)
