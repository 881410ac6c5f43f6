"""The hosts a chat runs on, from `--hosts a,b` or an mlx hostfile: read and checked once.

The front end parses them at the command line's boundary (`exokv.chat.run.validate`),
so a bad hostfile is a one-line error before anything starts, and the launcher's
planning (`exokv.wire.launch`) gets the parsed hosts instead of reading the file again.
"""

from __future__ import annotations

import ipaddress
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from exokv.errors import UsageError


@dataclass
class Host:
    ssh: str
    ips: list[str] = field(default_factory=list)


@dataclass
class HostList:
    """Hosts in rank order, with what their hostfile said besides."""

    hosts: list[Host]
    backend: str = ""  # the hostfile's "backend"; "" when it names none
    envs: list[str] = field(default_factory=list)  # the hostfile's "envs" (NAME=value)
    hostfile: Path | None = None  # where they were read from; None for --hosts


def parse_hosts(text: str) -> HostList:
    """`--hosts mac1,10.0.0.2`: an IP is its own address; a name is looked up later."""
    names = [h.strip() for h in text.split(",")]
    if not all(names):
        raise UsageError(f"invalid --hosts {text!r}: an empty name between commas")
    return HostList([Host(ssh=h, ips=[h] if is_ip(h) else []) for h in names])


def read_hostfile(path: str | os.PathLike[str]) -> HostList:
    """The hosts, backend and envs of an mlx hostfile; a bad file is a one-line UsageError.

    Accepts mlx's format: a JSON list of hosts, or an object with "hosts" (and
    optionally "backend" and "envs"); each host has "ssh" and optionally "ips".
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
        hosts.append(Host(ssh=entry["ssh"], ips=list(ips)))
    return HostList(hosts, backend, list(envs), p)


def is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True
