"""Every host's facts (exokv.hosts.probe), asked for all at once, with a time limit."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from exokv.hosts.probe import HostFacts, probe
from exokv.launch.remote import RemoteRun, run_on_each

PROBE_TIMEOUT_S = 30.0
_NO_MODULE = re.compile(r"No module named '([\w.]+)'")


@dataclass
class Answer:
    """What one host said: its facts, or one line saying why it gave none."""

    host: str | None  # None: this machine
    facts: HostFacts | None
    error: str = ""  # "" when `facts` came
    reached: bool = True  # ssh got through (a host can be reached and still fail)


def ask_hosts(
    hosts: Sequence[str | None], timeout: float = PROBE_TIMEOUT_S, model: str | None = None
) -> list[Answer]:
    """Every host's answer, in host order; None is this machine.

    `model`: each host also says whether that model is there (`HostFacts.model`).
    """
    remote = [h for h in hosts if h is not None]
    args = ["--model", model] if model is not None else []
    runs = iter(run_on_each(remote, "exokv.hosts.probe", lambda _: args, timeout=timeout))
    return [Answer(None, probe(model)) if h is None else _answer(h, next(runs)) for h in hosts]


def gather_facts(
    hosts: Sequence[str | None], timeout: float = PROBE_TIMEOUT_S, model: str | None = None
) -> list[HostFacts | str]:
    """Host i's facts, or one line saying why it gave none; None is this machine."""
    return [a.facts or a.error for a in ask_hosts(hosts, timeout, model)]


def _answer(host: str, run: RemoteRun) -> Answer:
    # ssh's own failures exit 255; a run cut off by the time limit may never have connected.
    reached = run.returncode is not None and run.returncode != 255
    if not run.ok:
        return Answer(host, None, _why(run), reached)
    try:
        return Answer(host, HostFacts.from_json(run.stdout.strip().splitlines()[-1]))
    except (ValueError, IndexError, TypeError):
        return Answer(host, None, f"no facts in its answer: {_last_line(run.stdout) or 'nothing'}")


def _why(run: RemoteRun) -> str:
    """One line for a probe that gave no facts, saying what to do where it is clear."""
    if run.error:
        return run.error
    last = _last_line(run.stderr)
    if run.returncode == 127:
        # The shell there found no such python: the ranks run the front end's python path.
        return f"{last or 'no such command'}: install the same environment at the same path there"
    missing = _NO_MODULE.search(run.stderr)
    if missing:
        package = missing.group(1).split(".")[0]
        return f"{package} is not installed in that python there: pip install {package} there"
    return last or f"exit {run.returncode}"


def _last_line(text: str) -> str:
    lines = [x.strip() for x in text.splitlines() if x.strip()]
    return lines[-1] if lines else ""
