"""The hosts a chat runs on, from `--hosts a,b` or an mlx hostfile: read and checked once.

The front end parses them at the command line's boundary (`exokv.frontend.start.validate`),
so a bad hostfile is a one-line error before anything starts, and the launcher's
planning (`exokv.launch.command`) gets the parsed hosts instead of reading the file again.

The format is mlx's own (`mlx/_distributed_utils/common.py`, `Hostfile.from_file`),
which `mlx.distributed_config` writes: `{"backend", "envs", "hosts": [{"ssh", "ips",
"rdma"}]}`, with "backend" "" (Ethernet, IPs looked up), "ring", "jaccl" or
"jaccl-ring" (RDMA over Thunderbolt 5: each host's "rdma" lists its device towards
every other host, null towards itself). Fields exokv has no use for (a host's
"rdma", anything newer) are kept in `Host.extra` and never rewritten: mlx.launch
reads the file itself.
"""

from __future__ import annotations

import ipaddress
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from exokv.errors import UsageError


@dataclass
class Host:
    ssh: str
    ips: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)  # the hostfile's other fields ("rdma")

    @property
    def rdma(self) -> list[Any]:
        """The jaccl devices towards each host (None towards itself); [] when not given."""
        value = self.extra.get("rdma", [])
        return value if isinstance(value, list) else []


@dataclass
class HostList:
    """Hosts in rank order, with what their hostfile said besides."""

    hosts: list[Host]
    backend: str = ""  # the hostfile's "backend"; "" when it names none (mlx.launch: ring)
    envs: list[str] = field(default_factory=list)  # the hostfile's "envs" (NAME=value)
    hostfile: Path | None = None  # where they were read from; None for --hosts


# What mlx.launch takes as a hostfile's "backend" ("" leaves it to the launcher: ring).
BACKENDS = ("", "ring", "jaccl", "jaccl-ring", "mpi", "nccl")


def parse_hosts(text: str) -> HostList:
    """`--hosts mac1,10.0.0.2`: an IP is its own address; a name is looked up later."""
    names = [h.strip() for h in text.split(",")]
    if not all(names):
        raise UsageError(f"invalid --hosts {text!r}: an empty name between commas")
    return HostList([Host(ssh=h, ips=[h] if is_ip(h) else []) for h in names])


def read_hostfile(path: str | os.PathLike[str]) -> HostList:
    """The hosts, backend and envs of an mlx hostfile; a bad file is a one-line UsageError.

    Accepts mlx's format: a JSON list of hosts, or an object with "hosts" (and
    optionally "backend" and "envs"); each host has "ssh" and optionally "ips" and
    "rdma" (jaccl), and whatever else it has is kept as it is.
    """
    p = Path(path).expanduser()
    where = f"hostfile {str(p)!r}"
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise UsageError(f"{where} does not exist") from None
    except (OSError, UnicodeDecodeError) as err:
        raise UsageError(f"cannot read {where}: {err}") from None
    except ValueError as err:
        raise UsageError(f"{where} is not valid JSON ({err})") from None
    backend = ""
    envs: list[str] = []
    if isinstance(data, dict):
        backend = data.get("backend", "") or ""
        entries = data.get("hosts")
        if not isinstance(backend, str):
            raise UsageError(f'{where}: "backend" must be a string')
        if backend not in BACKENDS:
            raise UsageError(
                f'{where}: unknown "backend" {backend!r}: use one of {", ".join(BACKENDS[1:])}'
            )
        envs = data.get("envs", [])
        if not isinstance(envs, list) or not all(isinstance(e, str) for e in envs):
            raise UsageError(f'{where}: "envs" must be a list of strings')
    else:
        entries = data
    if not isinstance(entries, list) or not entries:
        raise UsageError(f'{where}: expected a non-empty list of hosts (or {{"hosts": [...]}})')
    hosts = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or not isinstance(entry.get("ssh"), str) or not entry["ssh"]:
            raise UsageError(f'{where}: host {i} needs an "ssh" name')
        ips = entry.get("ips", [])
        if not isinstance(ips, list) or not all(isinstance(a, str) and is_ip(a) for a in ips):
            raise UsageError(f'{where}: host {i} ("{entry["ssh"]}") has "ips" that are not IPs')
        rdma = entry.get("rdma", [])
        if not isinstance(rdma, list) or not all(_is_device(d) for d in rdma):
            raise UsageError(
                f'{where}: host {i} ("{entry["ssh"]}") has "rdma" that is not a list of '
                "device names (or null)"
            )
        extra = {k: v for k, v in entry.items() if k not in ("ssh", "ips")}
        hosts.append(Host(ssh=entry["ssh"], ips=list(ips), extra=extra))
    return HostList(hosts, backend, list(envs), p)


def jaccl_problems(hosts: HostList) -> list[str]:
    """What mlx.launch would refuse in a jaccl hostfile, said before anything starts.

    The same rules as its `launch_jaccl`: rank 0 has an IP (the coordinator), every
    host lists one device (or a list of them) per host, null towards itself, and a
    device towards every host it talks to (its ring neighbours for "jaccl-ring").
    """
    if not hosts.backend.startswith("jaccl"):
        return []
    n = len(hosts.hosts)
    problems = []
    if not hosts.hosts[0].ips:
        problems.append(f'{hosts.hosts[0].ssh}: rank 0 needs "ips" (the jaccl coordinator)')
    for i, host in enumerate(hosts.hosts):
        if len(host.rdma) != n:
            problems.append(
                f'{host.ssh}: "rdma" lists {len(host.rdma)} devices for {n} hosts '
                "(one per host, null for itself): run mlx.distributed_config again"
            )
            continue
        if host.rdma[i] is not None:
            problems.append(f'{host.ssh}: its "rdma" device towards itself must be null')
        peers = {(i - 1) % n, (i + 1) % n} if hosts.backend == "jaccl-ring" else set(range(n))
        missing = [hosts.hosts[j].ssh for j in sorted(peers - {i}) if host.rdma[j] is None]
        if missing:
            problems.append(f'{host.ssh}: no "rdma" device towards {", ".join(missing)}')
    return problems


def _is_device(value: Any) -> bool:
    if value is None or isinstance(value, str):
        return True
    return isinstance(value, list) and all(isinstance(d, str) for d in value)


def is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True
