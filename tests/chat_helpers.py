"""Running `exokv` as a user would: a subprocess with its own EXOKV_HOME, a chat fed
one line at a time (`Chat`), or the REPL on a pseudo-terminal (`Terminal`)."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import select
import shutil
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path
from typing import Any

import psutil

# Six user turns, each asking something else, so every reply depends on its prompt.
SCRIPT = [
    "Hello, who are you?",
    "Tell me about the sea.",
    "Why is the sky blue?",
    "Write a short poem about winter.",
    "What is the capital of France?",
    "Thank you, goodbye.",
]


def run_exokv(
    args: list[str],
    home: Path,
    stdin: str | bytes = b"",
    timeout: float = 180,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[bytes]:
    full_env = {**os.environ, "EXOKV_HOME": str(home), **(env or {})}
    full_env.pop("EXOKV_DEBUG", None)
    data = stdin.encode() if isinstance(stdin, str) else stdin
    return subprocess.run(
        [sys.executable, "-m", "exokv", *args],
        input=data,
        capture_output=True,
        timeout=timeout,
        env=full_env,
    )


def chat_json(
    lines: list[str], home: Path, *extra: str, env: dict[str, str] | None = None
) -> list[dict[str, Any]]:
    """A script-mode chat on builtin:tiny; returns the per-turn JSON objects."""
    proc = run_exokv(
        ["chat", "--model", "builtin:tiny", "--json", "--max-tokens", "12", *extra],
        home,
        "\n".join(lines) + "\n",
        env=env,
    )
    assert proc.returncode == 0, proc.stderr.decode()
    docs = [json.loads(line) for line in proc.stdout.decode().splitlines() if line.strip()]
    return [d for d in docs if "turn" in d]


def home_with_models(path: Path, models: Path, link: bool = False) -> Path:
    """A fresh EXOKV_HOME holding the session's generated builtin models."""
    path.mkdir(parents=True, exist_ok=True)
    if link:
        (path / "models").symlink_to(models, target_is_directory=True)
    else:
        shutil.copytree(models, path / "models")
    return path


def exokv_text(
    home: Path, *args: str, stdin: str | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """`exokv ARGS` with text output; no stdin unless given, so nothing waits for a terminal."""
    env = {**os.environ, "EXOKV_HOME": str(home)}
    env.pop("EXOKV_DEBUG", None)
    return subprocess.run(
        [sys.executable, "-c", "from exokv.cli.app import main; main()", *args],
        env=env,
        input=stdin,
        stdin=None if stdin is not None else subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def cache_json(home: Path, *args: str) -> dict[str, Any]:
    """`exokv cache ARGS --json`, which must succeed, as a document."""
    proc = exokv_text(home, "cache", *args, "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def end_input(proc: subprocess.Popen, timeout: float) -> int:
    """Close a chat's standard input and wait up to `timeout` for it to end, killing it
    whatever happened: its exit code (a wait that times out raises, once it is killed)."""
    assert proc.stdin is not None
    try:
        proc.stdin.close()
    except BrokenPipeError:
        pass
    try:
        return proc.wait(timeout)
    finally:
        proc.kill()


class Chat:
    """`exokv chat --json` on builtin:tiny in a subprocess, fed one line at a time (stdin
    stays open between lines); it notes every process the chat starts (the ranks).

    `program` is what runs exokv: `python -m exokv` unless given (the installed command
    keeps the test's working folder off the front end's import path)."""

    def __init__(
        self,
        home: Path,
        *args: str,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
        program: list[str] | None = None,
        max_tokens: int = 8,
    ) -> None:
        full_env = {**os.environ, "EXOKV_HOME": str(home), **(env or {})}
        full_env.pop("EXOKV_DEBUG", None)
        self.proc = subprocess.Popen(
            [*(program or [sys.executable, "-m", "exokv"]), "chat", "--model", "builtin:tiny"]
            + ["--json", "--max-tokens", str(max_tokens), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=full_env,
            cwd=cwd,
        )
        self.seen: dict[int, psutil.Process] = {}

    def write(self, line: str) -> None:
        """Send one line and go on: its reply is left unread."""
        assert self.proc.stdin is not None
        self.proc.stdin.write((line + "\n").encode())
        self.proc.stdin.flush()

    def send(self, line: str) -> dict[str, Any]:
        assert self.proc.stdout is not None
        self.write(line)
        out = self.proc.stdout.readline()
        assert out, self.finish()[1]
        self.note_descendants()
        return json.loads(out)

    def note_descendants(self) -> None:
        for p in psutil.Process(self.proc.pid).children(recursive=True):
            self.seen.setdefault(p.pid, p)

    def tree(self) -> list[psutil.Process]:
        """The front end and every process below it now."""
        front = psutil.Process(self.proc.pid)
        return [front, *front.children(recursive=True)]

    def rank(self, r: int) -> psutil.Process:
        try:
            self.note_descendants()
        except psutil.Error:
            pass  # the front end has gone: the ranks it started are in `seen`
        for p in self.seen.values():
            try:
                if p.is_running() and p.environ().get("MLX_RANK") == str(r):
                    return p
            except psutil.Error:
                continue
        raise AssertionError(f"no rank {r} among {list(self.seen)}")

    def finish(self, timeout: float = 60) -> tuple[int, str]:
        """Close its input and wait for it to end: (exit code, standard error)."""
        end_input(self.proc, timeout)
        assert self.proc.stderr is not None
        return self.proc.returncode, self.proc.stderr.read().decode()

    def stderr(self, timeout: float = 0) -> str:
        """Its standard error, once it has ended (killed if still running after `timeout`)."""
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.proc.wait(10)
        assert self.proc.stderr is not None
        return self.proc.stderr.read().decode()

    def leftovers(self) -> list[int]:
        """Processes this chat started that are still alive (there must be none)."""
        deadline = time.monotonic() + 10
        while True:
            alive = [
                pid
                for pid, p in self.seen.items()
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE
            ]
            if not alive or time.monotonic() > deadline:
                return alive
            time.sleep(0.1)


ANSI = re.compile(
    r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[()][0-9A-Za-z]|\x1b[=>78]|\r"
)


def _take_terminal() -> None:  # runs in the child, after setsid: the pty becomes its tty
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


class Terminal:
    """A pseudo-terminal running one command; `expect` reads its screen output as text."""

    def __init__(
        self,
        args: list[str],
        env: dict[str, str],
        rows: int = 50,
        cols: int = 200,
        stdout: Any = None,
    ):
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
        self.proc = subprocess.Popen(
            args,
            stdin=slave,
            stdout=slave if stdout is None else stdout,
            stderr=slave,
            env={**env, "TERM": "xterm-256color", "PROMPT_TOOLKIT_NO_CPR": "1"},
            start_new_session=True,
            preexec_fn=_take_terminal,
            close_fds=True,
        )
        os.close(slave)
        self.fd = master
        self.raw = b""
        self.pos = 0

    def read(self, timeout: float) -> bool:
        """Read what the terminal shows within `timeout`; False once the child closed it."""
        ready, _, _ = select.select([self.fd], [], [], timeout)
        if not ready:
            return True
        try:
            data = os.read(self.fd, 65536)
        except OSError:  # the child closed the terminal
            return False
        self.raw += data
        return bool(data)

    @property
    def text(self) -> str:
        return ANSI.sub("", self.raw.decode("utf-8", "replace"))

    def expect(self, pattern: str, timeout: float = 30.0) -> re.Match[str]:
        """The next match of `pattern` after the previous one."""
        rx = re.compile(pattern)
        end = time.monotonic() + timeout
        while True:
            found = rx.search(self.text, self.pos)
            if found:
                self.pos = found.end()
                return found
            left = end - time.monotonic()
            alive = self.read(min(max(left, 0), 0.05))
            if left <= 0 or (not alive and self.proc.poll() is not None):
                tail = self.text[self.pos :][-2000:]
                raise AssertionError(f"no {pattern!r} on the terminal; it shows:\n{tail}")

    def type(self, text: str) -> None:
        os.write(self.fd, text.encode())

    def close(self, timeout: float = 30.0) -> int:
        end = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < end:
            self.read(0.05)
        while self.read(0.02) and select.select([self.fd], [], [], 0)[0]:
            pass
        if self.proc.poll() is None:
            self.proc.kill()
        code = self.proc.wait(timeout=5)
        os.close(self.fd)
        return code


def resumed_and_cold(
    home: Path,
    model: str,
    models: Path,
    first: str,
    second: str,
    max_tokens: int,
    cold: list[dict[str, Any]] | None = None,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A session's first turn, then its second in a new chat (its KV from the disk tier),
    and both turns again with --no-cache: (the resumed turn, the cold turns). `cold`: a
    --no-cache run of the same two turns made already (a slow model's is kept)."""
    env = {"EXOKV_MODELS": str(models)}
    args = ["chat", "--model", model, "--json", "--max-tokens", str(max_tokens)]

    def turns(*extra: str, stdin: str) -> list[dict[str, Any]]:
        proc = run_exokv([*args, *extra], home, stdin, env=env)
        assert proc.returncode == 0, proc.stderr.decode()
        return [json.loads(x) for x in proc.stdout.decode().splitlines() if '"turn"' in x]

    turns("--session", "s", stdin=f"{first}\n")
    resumed = turns("--session", "s", stdin=f"{second}\n")[0]
    return resumed, cold or turns("--no-cache", stdin=f"{first}\n{second}\n")
