"""A Mac gone for good, and the model does not fit on the hosts left (their memory
simulated by EXOKV_TEST_HOST_MEMORY): one line with the shortfall, exit 1, every
turn kept."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from chat_helpers import Chat, run_exokv
from test_host_gone import SCRIPT, hostfile_of

pytestmark = pytest.mark.slow  # starts ranks over ssh: see tests/conftest.py

# builtin:tiny fits on the three ([2, 1, 1] layers) but on neither split of A and B.
MEMORY = "exokv-a=2.2MB,exokv-b=1.4MB,exokv-c=2.2MB"


@pytest.mark.timeout(300)
def test_a_model_that_does_not_fit_on_the_hosts_left(tmp_path: Path, three_hosts) -> None:
    env = {
        "PATH": f"{three_hosts.bin_dir}:{os.environ['PATH']}",
        "EXOKV_TEST_HOST_MEMORY": MEMORY,
    }
    three = hostfile_of(tmp_path / "three.json", ["exokv-a", "exokv-b", "exokv-c"])
    home = tmp_path / "front"
    chat = Chat(
        home,
        *("--hostfile", str(three), "--starting-port", "30460", "--session", "kept"),
        env=env,
    )
    turns = [chat.send(line) for line in SCRIPT[:2]]
    assert [t["ranks"] for t in turns] == [3, 3]
    three_hosts.gone("exokv-c")
    chat.write(SCRIPT[2])
    code, err = chat.finish(timeout=120)
    assert code == 1, err
    errors = [line for line in err.splitlines() if line.startswith("exokv: error:")]
    assert len(errors) == 1, err
    assert "exokv-c is gone and the model does not fit on exokv-a, exokv-b" in errors[0]
    assert "short" in errors[0] or "need" in errors[0], errors[0]
    shown = run_exokv(["sessions", "show", "kept", "--json"], home)
    assert shown.returncode == 0, shown.stderr
    stored = json.loads(shown.stdout)
    assert stored["turns"] == 2  # every turn answered before the host went
    assert [m["content"] for m in stored["transcript"] if m["role"] == "user"] == SCRIPT[:2]
