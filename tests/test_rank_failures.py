"""A failure on one rank during a turn ends the turn on every rank together, with the
real error in one line (issue 18).

Injected through the rank's test-only hook (EXOKV_TEST_FAIL_AT=RANK:PHASE, see
exokv.rank.main.inject_failure), as a real failure there would raise. The chat
ends (exit 1): a rank that failed mid-turn may hold a cache the others do not.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from chat_helpers import home_with_models, run_exokv

pytestmark = pytest.mark.slow  # starts ranks, servers or real models: see tests/conftest.py

PORTS = {"1:insert": "25650", "1:decode": "25660", "0:prefill": "25670"}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("spec", list(PORTS))
def test_a_failure_on_one_rank_ends_the_turn_on_all(
    spec: str, tmp_path: Path, models_dir: Path
) -> None:
    rank, phase = spec.split(":")
    proc = run_exokv(
        ["chat", "--model", "builtin:tiny", "--json", "--max-tokens", "4", "-n", "2"]
        + ["--starting-port", PORTS[spec], "--restarts", "0"],
        home_with_models(tmp_path, models_dir),
        "Hello there, how are you?\nAnd again?\n",
        timeout=100,
        env={"EXOKV_TEST_FAIL_AT": spec},
    )
    err = proc.stderr.decode().strip()
    assert proc.returncode == 1, err
    # No turn is reported: not even the reply rank 0 finished while rank 1 failed
    # after it (insert), which the end-of-turn agreement holds back.
    turns = [json.loads(line) for line in proc.stdout.decode().splitlines() if line.strip()]
    assert [t for t in turns if "turn" in t] == []
    assert err.splitlines() == [
        f"exokv: error: rank {rank} failed: RuntimeError: injected failure in {phase} "
        "(EXOKV_TEST_FAIL_AT)"
    ]


@pytest.mark.timeout(180)
def test_a_request_that_fails_the_ranks_each_time_is_not_run_for_ever(
    tmp_path: Path, models_dir: Path
) -> None:
    """With restarts on, the ranks are started again and the request runs again; a
    request that fails them every time (a rank's own error on it) ends the chat after
    --restarts more runs, instead of starting the ranks again for ever."""
    proc = run_exokv(
        ["chat", "--model", "builtin:tiny", "--json", "--max-tokens", "4", "-n", "2"]
        + ["--starting-port", "25690", "--restarts", "1"],
        home_with_models(tmp_path, models_dir),
        "Hello there, how are you?\n",
        timeout=160,
        env={"EXOKV_TEST_FAIL_AT": "1:decode"},
    )
    err = proc.stderr.decode().strip()
    assert proc.returncode == 1, err
    assert "Traceback" not in err
    last = err.splitlines()[-1]
    assert last.startswith("exokv: error: rank 1 failed: RuntimeError: injected failure"), err
    assert last.endswith("; the request failed the ranks 2 times in a row"), err
    assert sum("starting the ranks again" in x for x in err.splitlines()) == 1, err
