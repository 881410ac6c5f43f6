"""The slow marker holds by construction: tests/conftest.py refuses, in a test without it,
what makes a test slow (ranks, an exokv subprocess, a server, a real model, the ssh hosts)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import StartsSlowThings, what_it_starts


@pytest.mark.parametrize(
    "argv",
    [
        [sys.executable, "-m", "exokv", "chat", "-n", "2"],
        [sys.executable, "-c", "from exokv.cli.app import main; main()", "bench"],
        [sys.executable, "-c", "import sys; from exokv.rank.main import main; sys.exit(main())"],
        ["/venv/bin/mlx.launch", "--hostfile", "h.json", "--", "python"],
        ["/venv/bin/exokv-launch", "-n", "2", "--", "python"],
        ["/venv/bin/exokv", "serve"],
        [sys.executable, "-m", "mlx_lm.server", "--port", "8080"],
        ["/usr/sbin/sshd", "-D"],
        ["ssh", "mac-b", "python -m exokv.hosts.facts"],
        "exokv chat --model builtin:tiny",
        [sys.executable, "-c", "from exokv.client.local import LocalClient\nLocalClient('m')"],
    ],
)
def test_what_starts_ranks_a_server_or_exokv_is_named(argv) -> None:
    assert what_it_starts(argv) is not None


@pytest.mark.parametrize(
    "argv",
    [
        ["git", "status"],
        [sys.executable, "-c", "from exokv.model.builtin import ensure_builtin as e; e('tiny')"],
        [sys.executable, "-c", "import time; time.sleep(60)"],
        [sys.executable, "-c", "import exokv.cli.app, exokv.serve.run, exokv.client.cluster"],
        [sys.executable, "-c", "import exokv.client.local"],
        ["bash", "--norc", "-c", "source completions/exokv.bash"],
        ["ssh", "-G", "mac-a"],
        [],
    ],
)
def test_a_tiny_python_or_a_tool_is_not(argv) -> None:
    assert what_it_starts(argv) is None


def test_an_unmarked_test_cannot_start_exokv() -> None:
    with pytest.raises(StartsSlowThings, match="this test starts python -m exokv: mark it slow"):
        subprocess.run([sys.executable, "-m", "exokv", "--version"], timeout=60)


def test_an_unmarked_test_cannot_start_a_uvicorn_server() -> None:
    import uvicorn

    with pytest.raises(StartsSlowThings, match="a uvicorn server"):
        uvicorn.Server(uvicorn.Config(app=None))


def test_an_unmarked_test_cannot_fetch_a_real_model() -> None:
    from exokv.model import smollm2

    with pytest.raises(StartsSlowThings, match="a real model"):
        smollm2.ensure_smollm2()


def test_other_subprocesses_run() -> None:
    done = subprocess.run([sys.executable, "-c", "print('ok')"], capture_output=True, text=True)
    assert done.stdout == "ok\n"


@pytest.mark.slow
def test_a_slow_test_may(tmp_path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "exokv", "--version"],
        capture_output=True,
        timeout=120,
        env={"EXOKV_HOME": str(tmp_path), "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stderr
