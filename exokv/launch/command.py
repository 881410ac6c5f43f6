"""Building the `mlx.launch` command line, and checking what it is given first.

The ranks are always started by mlx's own launcher. This module only decides
its arguments: `-n` for ranks on this machine, `--hosts` or `--hostfile` for
several machines (read and checked before, by exokv.hosts.hostfile), the backend and the
first port.

Ranks start with an import path that leaves out the working folder (see
`rank_command`): a `secrets.py` or `concurrent.py` where the user happens to
run `exokv chat` must neither run nor shadow the standard library in a rank.

The channel's token never appears on a command line or in an environment
variable (both can be read by other users through `ps`): the front end writes
one bootstrap line to the launcher's standard input, which the launcher
forwards to the ranks, and only rank 0 reads it (see `exokv.rank.boot`).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from exokv.config import FORWARDED_ENV
from exokv.errors import ExokvError, UsageError
from exokv.hosts.hostfile import Host, HostList, is_ip

LOOPBACK = "127.0.0.1"
DEFAULT_STARTING_PORT = 32323  # mlx.launch's own default
# What a rank prints through the launcher, read by the front end (both sides import this).
ERROR_MARK = "exokv-rank-error "  # stderr lines the front end turns into its one-line error
BEAT_MARK = "exokv-beat "  # stdout lines: this rank is alive (see exokv.rank.boot.beat)
STATE_MARK = "exokv-state "  # stderr lines: the rank process as its host sees it (wire/watcher)
SCRATCH_PREFIX = "exokv-ranks-"  # the launcher's temporary folder, made by the front end


def make_scratch() -> Path:
    """The launcher's temporary folder, given to the local ranks as their TMPDIR.

    MLX's CPU backend keeps the kernels it compiles (g++, a second or more each) under
    $TMPDIR/mlx; a fresh TMPDIR per chat would compile them again at every start. So
    the folder's `mlx` is a link to the one MLX uses outside exokv, and removing the
    folder removes the link alone."""
    scratch = Path(tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{os.getpid()}-"))
    kernels = Path(tempfile.gettempdir()) / "mlx"
    try:
        kernels.mkdir(exist_ok=True)
        (scratch / "mlx").symlink_to(kernels, target_is_directory=True)
    except OSError:
        pass  # the kernels are compiled again, as without the link: slower, not wrong
    return scratch


def remove_scratch() -> None:
    """The front end was killed and cannot remove the launcher's temporary folder (see
    ClusterClient): a local rank, or its watcher, which inherited it as TMPDIR, does."""
    scratch = os.environ.get("TMPDIR", "")
    if os.path.basename(scratch).startswith(SCRATCH_PREFIX):
        shutil.rmtree(scratch, ignore_errors=True)


@dataclass
class LaunchPlan:
    """What to start: the launcher's argv and where the channel must listen."""

    argv: list[str]
    ranks: int
    hosts: list[Host]
    backend: str
    local: bool  # every rank on this machine: the channel binds to loopback only
    bind_host: str
    starting_port: int


def plan_launch(
    command: list[str],
    ranks: int = 1,
    hosts: HostList | None = None,
    backend: str = "ring",
    starting_port: int | None = None,
    env: dict[str, str] | None = None,
    scratch: Path | None = None,
) -> LaunchPlan:
    """The mlx.launch invocation that runs `command` (a python argv) on every rank: on
    `hosts` (parsed and checked by exokv.hosts.hostfile) or else `ranks` ranks on this machine.

    `scratch`: a folder of ours where a hostfile is written when hosts given by
    name need their IPs filled in for the ring backend (mlx.launch refuses names).
    """
    args = [launcher()]
    if hosts is not None and hosts.hostfile is not None:
        if hosts.backend and backend == "ring":
            # --backend defaults to ring; a hostfile that names its backend wins over the default.
            backend = hosts.backend
        args += ["--hostfile", str(hosts.hostfile)]
    elif hosts is not None:
        args += ["--hosts", ",".join(h.ssh for h in hosts.hosts)]
    # A copy: the addresses looked up below are this launch's, not the options'.
    host_list = (
        [Host(h.ssh, list(h.ips)) for h in hosts.hosts]
        if hosts is not None
        else [Host(LOOPBACK, [LOOPBACK]) for _ in range(ranks)]
    )
    if hosts is None:
        args += ["-n", str(ranks)]
    # Hosts by name without a hostfile of their own (the hosts left after a re-plan) go
    # to the launcher in one of ours, with their addresses: the ring refuses names.
    named = (
        hosts is not None and hosts.hostfile is None and any(h.ssh not in h.ips for h in host_list)
    )
    if backend == "ring" and (named or any(not h.ips for h in host_list)):
        _fill_in_ips(args, host_list, hosts, scratch)
    local = all(h.ssh == LOOPBACK for h in host_list)
    if starting_port is None:
        starting_port = free_ports(len(host_list)) if local else DEFAULT_STARTING_PORT
    if not 0 < starting_port < 65536 - len(host_list):
        raise UsageError(f"--starting-port {starting_port} is not a usable port")
    args += ["--backend", backend, "--starting-port", str(starting_port)]
    if not local:
        # Local ranks inherit this environment; remote ones only get what is forwarded.
        args += _forwarded_env(env)
    args += ["--", *command]
    return LaunchPlan(
        argv=args,
        ranks=len(host_list),
        hosts=host_list,
        backend=backend,
        local=local,
        bind_host=LOOPBACK if local else route_to(host_list[0]),
        starting_port=starting_port,
    )


def _fill_in_ips(
    args: list[str], host_list: list[Host], hosts: HostList | None, scratch: Path | None
) -> None:
    """Each host without an address given looked up, and the launcher's `args` pointed at
    a hostfile (in `scratch`) that has them: the ring backend refuses names."""
    # `mac-studio.local` is what people type: look its address up, as ssh would.
    for h in host_list:
        if not h.ips:
            h.ips = [resolve_host(h.ssh)]
    written = _write_hostfile(host_list, hosts.envs if hosts else [], scratch)
    flag = "--hostfile" if hosts is not None and hosts.hostfile is not None else "--hosts"
    args[args.index(flag) : args.index(flag) + 2] = ["--hostfile", str(written)]


def _forwarded_env(env: dict[str, str] | None) -> list[str]:
    """mlx.launch's --env flags for the settings remote ranks get (FORWARDED_ENV that are
    set in `env`, else in this environment)."""
    flags: list[str] = []
    for name in FORWARDED_ENV:
        value = (env if env is not None else os.environ).get(name)
        if value is not None:
            flags += ["--env", f"{name}={value}"]
    return flags


def check_reachable(plan: LaunchPlan, timeout: float = 5.0) -> None:
    """A one-line error, before launching, for a host that ssh cannot reach.

    mlx.launch runs plain `ssh host ...`; an unreachable host would leave it waiting
    on ssh's own connect timeout (minutes), so each remote host's ssh port is tried
    first, all at once, for a few seconds.
    """
    if plan.local:
        return
    remote = [(r, h.ssh) for r, h in enumerate(plan.hosts) if h.ssh != LOOPBACK]
    with ThreadPoolExecutor(max_workers=len(remote)) as pool:
        results = list(pool.map(lambda rh: _probe(rh[1], timeout), remote))
    for (rank, name), error in zip(remote, results, strict=True):
        if error:
            raise ExokvError(f"rank {rank}'s host {name!r} cannot be reached over ssh: {error}")


def ssh_names(hosts: Sequence[Host]) -> list[str | None]:
    """Each host's ssh name, None for this machine (what exokv.launch.remote runs here)."""
    return [None if h.ssh == LOOPBACK else h.ssh for h in hosts]


def unreachable(names: Sequence[str], timeout: float = 5.0) -> dict[str, str]:
    """The hosts among `names` whose ssh server does not answer now, with why; all
    tried at once (the front end deciding that a host is gone)."""
    names = [n for n in dict.fromkeys(names) if n != LOOPBACK]
    if not names:
        return {}
    with ThreadPoolExecutor(max_workers=len(names)) as pool:
        results = list(pool.map(lambda n: _probe(n, timeout), names))
    return {n: why for n, why in zip(names, results, strict=True) if why}


def ssh_target(name: str) -> tuple[str, int]:
    """The address and port ssh would use for `name` (its config applied), without connecting."""
    try:
        out = subprocess.run(
            ["ssh", "-G", name], capture_output=True, text=True, timeout=5, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return name, 22
    conf = dict(line.split(" ", 1) for line in out.splitlines() if " " in line)
    try:
        return conf.get("hostname", name), int(conf.get("port", "22"))
    except ValueError:
        return conf.get("hostname", name), 22


def _probe(name: str, timeout: float) -> str:
    """'' if an ssh server answers at `name`: it greets first, with 'SSH-'."""
    host, port = ssh_target(name)
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            greeting = sock.recv(4)
    except TimeoutError:
        return f"{host}:{port}: no answer within {timeout:.0f} s"
    except OSError as err:
        return f"{host}:{port}: {err.strerror or err}"
    return "" if greeting == b"SSH-" else f"{host}:{port}: no ssh server answered"


def launcher() -> str:
    """exokv-launch (mlx.launch, paced: exokv.launch.paced) from the same environment as
    this python, else from PATH; mlx.launch itself where exokv was not installed."""
    for name in ("exokv-launch", "mlx.launch"):
        beside = Path(sys.executable).parent / name
        if beside.exists():
            return str(beside)
        found = shutil.which(name)
        if found is not None:
            return found
    raise ExokvError("mlx.launch not found: install mlx in this environment (pip install mlx)")


# `python -m` (and `-c`) put the working folder first on sys.path, where a user's
# `secrets.py` would run in every rank and shadow the standard library. `-P` is
# 3.11+ and `-I` also drops PYTHONPATH, so the rank's own first line takes the
# folder out, before anything else is imported; it is the same on any host's python.
_ENTRY = (
    "import sys; sys.path[:] = [p for p in sys.path if p not in ('', '.')]; "
    "from {module} import main; sys.exit(main())"
)


def rank_command(python: str | None = None, module: str = "exokv.rank.main") -> list[str]:
    """The argv that starts one rank (the launcher runs it once per rank): `module`'s
    main() with the arguments that follow, as `python -m module` would but for sys.path."""
    return [python or sys.executable, "-c", _ENTRY.format(module=module)]


def channel_addresses(plan: LaunchPlan, port: int) -> list[str]:
    """Where rank 0 reaches the front end's channel: the one address it listens on."""
    return [f"{plan.bind_host}:{port}"]


def route_to(host: Host) -> str:
    """This machine's address on the way to `host`: the only one the channel listens on.

    Listening on every interface (0.0.0.0) would offer the channel to every network
    this machine is on; rank 0 needs exactly the address its host can reach.
    """
    target = host.ips[0] if host.ips else resolve_host(host.ssh)
    try:
        # A UDP "connect" sends nothing; it asks the kernel which local address routes there.
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((target, 9))
            return str(s.getsockname()[0])
    except OSError as err:
        raise ExokvError(f"no route from this machine to rank 0's host {target}: {err}") from None


def resolve_host(name: str) -> str:
    """The IPv4 address ssh would connect to for `name` (its ssh config applied)."""
    target, _ = ssh_target(name)
    if is_ip(target):
        return target
    try:
        found = socket.getaddrinfo(target, None, socket.AF_INET, socket.SOCK_STREAM)
    except (OSError, UnicodeError) as err:
        raise UsageError(
            f"host {name!r} has no IP address ({target!r} does not resolve: {err}); "
            'give its "ips" in a --hostfile'
        ) from None
    return str(found[0][4][0])


def _write_hostfile(hosts: list[Host], envs: list[str], scratch: Path | None) -> Path:
    if scratch is None:
        raise ExokvError("hosts without IPs need a scratch folder for their hostfile")
    path = Path(scratch) / "hostfile.json"
    body = {"hosts": [{"ssh": h.ssh, "ips": h.ips} for h in hosts], "envs": envs}
    path.write_text(json.dumps(body))
    return path


def free_ports(count: int, start: int = 20000, end: int = 60000) -> int:
    """The first of `count` consecutive ports that are free on loopback now.

    Starting from a random offset keeps two chats on one machine apart.
    """
    base = random.randrange(start, end - count)
    for offset in range(0, end - start, count + 1):
        first = start + (base - start + offset) % (end - start - count)
        if all(_port_free(first + i) for i in range(count)):
            return first
    raise ExokvError("no free ports on this machine for the ranks; pass --starting-port")


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((LOOPBACK, port))
        except OSError:
            return False
    return True
