"""Running one exokv module on a host before (or instead of) the ranks: over ssh, or here.

Fetching a model's files onto each host, asking each host for its memory and
versions, and `exokv hosts check` all run a short python module on every host at
once, with a time limit. The command is the ranks' own (`launch.rank_command`:
the same python path, the working folder off sys.path), reached the way
mlx.launch reaches a host: plain `ssh HOST CMD` in batch mode, so a host that
would ask for a password fails at once instead of waiting at a prompt. Remote
hosts get only the forwarded settings and a hostfile's envs in their environment,
as ranks do.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from exokv.config import FORWARDED_ENV
from exokv.launch.command import rank_command

SSH_CONNECT_TIMEOUT_S = 10


@dataclass
class RemoteRun:
    """What one host answered."""

    host: str  # the ssh name, or "" for this machine
    returncode: int | None  # None: it did not finish (timed out, or ssh could not start)
    stdout: str
    stderr: str
    error: str = ""  # one line: why it did not run to the end; "" when it did

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.error


def run_module(
    host: str | None,
    module: str,
    args: Sequence[str] = (),
    *,
    timeout: float,
    on_line: Callable[[str], None] | None = None,
    env: dict[str, str] | None = None,
    envs: Sequence[str] = (),
) -> RemoteRun:
    """`module`'s main(args) on `host` (None: this machine), its output collected.

    `on_line` sees each stdout line as it comes (progress); the run is ended once
    `timeout` seconds pass, and then `error` says so. `envs` (NAME=value, a hostfile's
    "envs") are set for the module as mlx.launch sets them for the ranks.
    """
    command, child_env = module_command(host, module, args, envs, env)
    name = host or ""
    try:
        proc = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=child_env,
            start_new_session=True,  # a Ctrl-C at the front end is the front end's to handle
        )
    except OSError as err:
        return RemoteRun(name, None, "", "", f"could not start {command[0]}: {err.strerror}")
    return _collected(proc, name, host is not None, timeout, on_line)


def module_command(
    host: str | None,
    module: str,
    args: Sequence[str] = (),
    envs: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
) -> tuple[list[str], dict[str, str]]:
    """The command running `module`'s main(args) on `host` (None: here), and the
    environment to start it with: what `run_module` runs, for a caller that wires the
    process up itself (exokv.hosts.kvfiles pipes one host's output into another's).
    `env` is this machine's environment unless given; `envs` as in `run_module`."""
    argv = [*rank_command(module=module), *args]
    return _command(host, argv, os.environ if env is None else env, envs)


def _command(
    host: str | None, argv: list[str], source: Mapping[str, str], envs: Sequence[str]
) -> tuple[list[str], dict[str, str]]:
    """The command running `argv` on `host` (None: here) and its environment: here,
    `source` with `envs` set; over ssh, this environment, and on the remote command line
    `source`'s forwarded settings and `envs`."""
    if host is None:
        return argv, {**source, **dict(e.partition("=")[::2] for e in envs)}
    forwarded = [f"{n}={source[n]}" for n in FORWARDED_ENV if source.get(n) is not None]
    forwarded += list(envs)
    remote = shlex.join(["env", *forwarded, *argv] if forwarded else argv)
    command = [
        "ssh",
        "-o",
        "BatchMode=yes",
        "-o",
        f"ConnectTimeout={SSH_CONNECT_TIMEOUT_S}",
        host,
        remote,
    ]
    return command, dict(os.environ)


def _collected(
    proc: subprocess.Popen[str],
    name: str,
    over_ssh: bool,
    timeout: float,
    on_line: Callable[[str], None] | None,
) -> RemoteRun:
    """What `proc` wrote until it ended, or until `timeout` seconds passed (it is killed
    then); over ssh, exit status 255 is ssh's own failure, named by its last line."""
    out: list[str] = []
    err_lines: list[str] = []

    def read_out() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            out.append(line)
            if on_line is not None:
                on_line(line.rstrip("\n"))

    def read_err() -> None:
        assert proc.stderr is not None
        err_lines.extend(proc.stderr)

    readers = [threading.Thread(target=f, daemon=True) for f in (read_out, read_err)]
    for reader in readers:
        reader.start()
    deadline = time.monotonic() + timeout
    try:
        proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        for reader in readers:
            reader.join(timeout=1)
        return RemoteRun(
            name, None, "".join(out), "".join(err_lines), f"no answer within {timeout:.0f} s"
        )
    for reader in readers:
        reader.join(timeout=5)
    stderr = "".join(err_lines)
    error = ""
    if over_ssh and proc.returncode == 255:
        # ssh's own failure (unreachable, refused, no key): its last line says why.
        lines = [x for x in stderr.splitlines() if x.strip()]
        error = lines[-1].strip() if lines else "ssh failed"
    return RemoteRun(name, proc.returncode, "".join(out), stderr, error)


def run_on_each(
    hosts: Sequence[str | None],
    module: str,
    args_for: Callable[[int], Sequence[str]],
    *,
    timeout: float,
    on_line: Callable[[int, str], None] | None = None,
    envs: Sequence[str] = (),
) -> list[RemoteRun]:
    """`module` on every host at once (host i with `args_for(i)`), answers in host order."""
    if not hosts:
        return []

    def one(i: int) -> RemoteRun:
        line = (lambda text: on_line(i, text)) if on_line is not None else None
        return run_module(hosts[i], module, args_for(i), timeout=timeout, on_line=line, envs=envs)

    with ThreadPoolExecutor(max_workers=len(hosts)) as pool:
        return list(pool.map(one, range(len(hosts))))
