"""Two-rank chats against real processes: what the ranks import, what they leave
behind, what they cost while idle, and how a chat ends when a rank dies at the prompt.

Every chat runs the installed `exokv` command (not `python -m exokv`, which would
put the test's working folder on the front end's own import path) on builtin:tiny.
"""

from __future__ import annotations

import json
import os
import re
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
from chat_helpers import Chat, Terminal, home_with_models

pytestmark = pytest.mark.slow  # starts ranks, servers or real models: see tests/conftest.py

EXOKV = str(Path(sys.executable).with_name("exokv"))
IDLE_WINDOW_S = 10.0
IDLE_BOUND = 0.05  # of one core, per process: a spinning rank uses ~1.0
STARTUP_BOUND = 0.25  # the launcher's, from its start through a first turn: ~0.6 spinning
DETECT_BOUND_S = 15.0


def exokv_env(home: Path, **extra: str) -> dict[str, str]:
    env = {**os.environ, "EXOKV_HOME": str(home), **extra}
    env.pop("EXOKV_DEBUG", None)
    return env


def two_ranks(home: Path, port: int, cwd: Path | None = None, **env: str) -> Chat:
    """`exokv chat -n 2 --json` through the installed command, fed one line at a time."""
    # --restarts 0: a rank that dies ends the chat (tests/test_heal.py: it heals)
    return Chat(
        home,
        *("-n", "2", "--starting-port", str(port), "--restarts", "0"),
        env=env,
        cwd=cwd,
        program=[EXOKV],
        max_tokens=6,
    )


def _cpu(p: psutil.Process) -> float | None:
    try:
        t = p.cpu_times()
    except psutil.Error:
        return None
    return t.user + t.system


@pytest.mark.timeout(120)
def test_ranks_ignore_the_working_folder_and_leave_no_temp_files(
    tmp_path: Path, models_dir: Path
) -> None:
    # A user's own modules named like the standard library's, in the folder the chat
    # starts in: a rank that imports them runs them (each leaves a marker file).
    work = tmp_path / "work"
    work.mkdir()
    for name in ("secrets", "concurrent"):
        (work / f"{name}.py").write_text(
            f"open({str(work / ('imported-' + name))!r}, 'w').close()\n"
        )
    temp = tmp_path / "temp"
    temp.mkdir()
    home = home_with_models(tmp_path / "h", models_dir)
    chat = two_ranks(home, 28100, cwd=work, TMPDIR=str(temp))
    assert chat.send("Hello there")["turn"] == 1
    assert chat.proc.stdin is not None
    chat.proc.stdin.close()
    err = chat.stderr(timeout=30)
    assert chat.proc.returncode == 0, err
    assert sorted(p.name for p in work.iterdir()) == ["concurrent.py", "secrets.py"]
    # mlx.launch makes a pid file and a hostfile per rank with mktemp: none is left.
    # What stays is MLX's own cache of compiled CPU kernels, as without exokv.
    assert [p.name for p in temp.iterdir()] == ["mlx"] and not (temp / "mlx").is_symlink()


@pytest.mark.timeout(150)
def test_an_idle_two_rank_chat_leaves_the_cores_alone(tmp_path: Path, models_dir: Path) -> None:
    chat = two_ranks(home_with_models(tmp_path / "h", models_dir), 28110)
    try:
        assert chat.send("Hello there")["turn"] == 1
        time.sleep(2)  # the turn's own work is over
        procs = chat.tree()
        assert len(procs) >= 4, procs  # front end, launcher, two ranks
        # Nor while they started: spinning on the ranks' stdin until they were ready,
        # the launcher took half the cores of a 2-core machine from their start-up.
        (launcher,) = [p for p in procs if any("exokv-launch" in a for a in p.cmdline())]
        spent, age = _cpu(launcher), time.time() - launcher.create_time()
        assert spent is not None and spent / age < STARTUP_BOUND, (spent, age)
        before = {p.pid: _cpu(p) for p in procs}
        tic = time.monotonic()
        time.sleep(IDLE_WINDOW_S)
        elapsed = time.monotonic() - tic
        used = {}
        for p in procs:
            after = _cpu(p)
            if after is not None and before[p.pid] is not None:
                used[" ".join(p.cmdline()[:3])[-60:] + f" [{p.pid}]"] = (
                    after - before[p.pid]
                ) / elapsed
        assert len(used) == len(procs), "a process of the chat ended while idle"
        busy = {name: f"{share:.0%}" for name, share in used.items() if share > IDLE_BOUND}
        assert not busy, f"processes using a core while the chat waits for input: {busy}"
        # A stranger's hello nested 2,000 deep is refused and closed, silently for the chat.
        refusal = poke_channel(chat.proc.pid, b"[" * 2000 + b"]" * 2000)
        assert refusal["type"] == "refused" and "malformed" in refusal["reason"]
        # And the ranks still answer after the long wait.
        assert chat.send("Still there?")["turn"] == 2
        assert chat.proc.stdin is not None
        chat.proc.stdin.close()
        err = chat.stderr(timeout=30)
        assert chat.proc.returncode == 0 and err == "", err
    finally:
        chat.stderr()


def poke_channel(front_end: int, body: bytes) -> dict[str, Any]:
    """Send one framed message to the chat's channel as a stranger; its one answer,
    after which the chat must have closed the connection."""
    import socket

    listening = [
        c.laddr
        for c in psutil.Process(front_end).net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN
    ]
    assert len(listening) == 1, listening
    with socket.create_connection(tuple(listening[0]), timeout=10) as sock:
        sock.sendall(struct.pack(">I", len(body)) + body)
        data = b""
        while chunk := sock.recv(65536):  # ends only when the chat closes its side
            data += chunk
    (size,) = struct.unpack(">I", data[:4])
    assert len(data) == 4 + size, "more than one answer"
    return json.loads(data[4:])


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("how", "port", "says"),
    [
        ("kill", 28120, "rank 1 was killed by SIGKILL"),
        ("suspend", 28140, "rank 1 stopped responding"),  # SIGTERM: the REPL test below
    ],
)
def test_a_rank_lost_while_idle_ends_a_script_chat(
    tmp_path: Path, models_dir: Path, how: str, port: int, says: str
) -> None:
    home = home_with_models(tmp_path / "h", models_dir)
    chat = two_ranks(home, port)
    assert chat.send("Hello there")["turn"] == 1
    assert chat.send("/new second")["ok"]
    assert chat.send("Why is the sky blue")["turn"] == 1
    rank1 = chat.rank(1)
    getattr(rank1, how)()
    tic = time.monotonic()
    try:
        chat.proc.wait(DETECT_BOUND_S + 5)  # stdin stays open: nothing else ends it
    except subprocess.TimeoutExpired:
        pass
    elapsed = time.monotonic() - tic
    err = chat.stderr()
    if how == "suspend":
        rank1.kill()  # a stopped process outlives the process group's SIGTERM
    assert elapsed < DETECT_BOUND_S, f"the chat noticed after {elapsed:.1f} s: {err}"
    assert chat.proc.returncode == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], err  # said once, naming the rank
    # The finished turns are kept.
    from exokv.state import Store

    with Store.open(home) as store:
        assert len(store.load_messages("second")) == 2
        assert len([n for n in store.session_names() if n != "second"]) == 1


@pytest.mark.timeout(120)
def test_the_repl_ends_when_a_rank_dies_at_the_prompt(tmp_path: Path, models_dir: Path) -> None:
    home = home_with_models(tmp_path / "h", models_dir)
    args = [EXOKV, "chat", "-m", "builtin:tiny", "-n", "2", "--max-tokens", "6", "--restarts", "0"]
    term = Terminal([*args, "--session", "s", "--starting-port", "28150"], exokv_env(home))
    try:
        term.expect(r"s › ", 90)
        os.write(term.fd, b"Hello there\r")
        deadline = time.monotonic() + 60
        while _stored_messages(home, "s") < 2:  # the turn is over once it is stored
            assert time.monotonic() < deadline, term.text
            term.read(0.2)
        front = psutil.Process(term.proc.pid)
        rank1 = next(p for p in front.children(recursive=True) if _is_rank(p, 1))
        # SIGTERM, which the launcher also sends every rank once one has gone: the
        # rank that went first is named, not rank 0 "losing a peer".
        rank1.send_signal(signal.SIGTERM)
        tic = time.monotonic()
        says = "rank 1 was terminated (SIGTERM)"
        term.expect(re.escape(says), DETECT_BOUND_S)
        try:
            os.write(term.fd, b"/quit\r")  # too late: the chat has ended with the error
        except OSError:
            pass  # the terminal is already closed
        code = term.proc.wait(10)
        assert time.monotonic() - tic < DETECT_BOUND_S
        assert code == 1, term.text
        assert term.text.count(says) == 1, term.text
    finally:
        if term.proc.poll() is None:
            term.proc.kill()
        os.close(term.fd)
    assert _stored_messages(home, "s") == 2


def _stored_messages(home: Path, session: str) -> int:
    from exokv.state import Store

    store = Store.open_existing(home)
    if store is None:
        return 0
    with store:
        return len(store.load_messages(session))


def _is_rank(p: psutil.Process, r: int) -> bool:
    try:
        return p.environ().get("MLX_RANK") == str(r)
    except psutil.Error:
        return False
