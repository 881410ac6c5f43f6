"""Every host's facts (exokv.hostprobe), asked for all at once, with a time limit."""

from __future__ import annotations

from collections.abc import Sequence

from exokv.hostprobe import HostFacts, probe
from exokv.wire.remote import run_on_each

PROBE_TIMEOUT_S = 30.0


def gather_facts(
    hosts: Sequence[str | None], timeout: float = PROBE_TIMEOUT_S
) -> list[HostFacts | str]:
    """Host i's facts, or one line saying why it gave none; None is this machine."""
    remote = [h for h in hosts if h is not None]
    runs = iter(run_on_each(remote, "exokv.hostprobe", lambda _: [], timeout=timeout))
    answers: list[HostFacts | str] = []
    for host in hosts:
        if host is None:
            answers.append(probe())
            continue
        run = next(runs)
        if not run.ok:
            answers.append(run.error or _last_line(run.stderr) or f"exit {run.returncode}")
            continue
        try:
            answers.append(HostFacts.from_json(run.stdout.strip().splitlines()[-1]))
        except (ValueError, IndexError):
            answers.append(f"no facts in its answer: {_last_line(run.stdout) or 'nothing'}")
    return answers


def _last_line(text: str) -> str:
    lines = [x.strip() for x in text.splitlines() if x.strip()]
    return lines[-1] if lines else ""
