"""`exokv models --hosts/--hostfile`: the catalogue of every host, each read on its host."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from exokv.hosts.hostfile import HostList
from exokv.launch.remote import run_on_each

LISTING = "exokv.model.catalogue"
LIST_TIMEOUT_S = 120


@dataclass
class HostModels:
    host: str
    models: list[dict[str, Any]] | None  # None: the host did not answer
    error: str = ""  # one line: why not


def models_on_hosts(hosts: HostList) -> list[HostModels]:
    """Each distinct host's models (list_models on that host, in its own caches), in order."""
    names = list(dict.fromkeys(h.ssh for h in hosts.hosts))
    runs = run_on_each(names, LISTING, lambda i: [], timeout=LIST_TIMEOUT_S, envs=hosts.envs)
    found = []
    for name, run in zip(names, runs, strict=True):
        models: list[dict[str, Any]] | None = None
        error = run.error
        if run.ok:
            try:
                models = json.loads(run.stdout.strip().splitlines()[-1])
            except (ValueError, IndexError):
                error = "its listing was not JSON"
        elif not error:
            lines = [x.strip() for x in run.stderr.splitlines() if x.strip()]
            error = lines[-1][:300] if lines else f"exited with code {run.returncode}"
        found.append(HostModels(name, models, error))
    return found
