"""A hub model's files onto every host before the ranks load: each host only its part.

``fetch_onto_hosts`` runs just before the ranks launch. On this machine alone (one
rank, or ``-n``) it fetches what the ranks load here, with huggingface_hub's own
progress bars. With ``--hosts``/``--hostfile`` it first fetches the config and
tokenizer here (the front end tokenizes and names the model's identity, and learns
the commit the revision names, so every host fetches the same one), then runs
exokv.model.fetcher on every host at once through exokv.wire.remote, each in its
own Hugging Face cache and for its own ranks' layers, and shows each host's
progress. A host that fails ends the start with one line naming it.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

from exokv.errors import ExokvError
from exokv.hosts import HostList
from exokv.model import hub
from exokv.sizes import format_size
from exokv.wire.remote import RemoteRun, run_on_each

FETCHER = "exokv.model.fetcher"
# A host's fetch is ended after this long: a stalled download fails sooner on its own
# (huggingface_hub's read timeout); this bounds a host that never answers at all.
FETCH_TIMEOUT_S = 12 * 3600


def _say(text: str) -> None:
    print(f"exokv: {text}", file=sys.stderr, flush=True)


def fetch_onto_hosts(
    model: str,
    hosts: HostList | None,
    split: list[int] | None,
    parallel: str,
    say: Callable[[str], None] = _say,
) -> None:
    """Every host holds the files of ``model`` its ranks load; nothing to do unless
    ``model`` names a hub repo (``org/name[@revision]``) rather than a local model."""
    name = hub.repo_of(model)
    if name is None:
        return
    repo, revision = name
    if hosts is None:
        bars = sys.stderr.isatty()
        hub.fetch(repo, revision, progress=_local_progress(repo, say, bars), bars=bars)
        return
    here = hub.fetch(repo, revision, hub.Want(host_ranks=None))
    machines: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts.hosts):
        machines.setdefault(host.ssh, []).append(rank)
    names = list(machines)
    ranks = len(hosts.hosts)

    def args_for(i: int) -> list[str]:
        args = ["--model", model, "--commit", here.commit, "--ranks", str(ranks)]
        args += ["--host-ranks", ",".join(map(str, machines[names[i]])), "--parallel", parallel]
        return args + (["--split", ",".join(map(str, split))] if split else [])

    shown = _HostProgress(repo, names, say)
    runs = run_on_each(
        names, FETCHER, args_for, timeout=FETCH_TIMEOUT_S, on_line=shown.line, envs=hosts.envs
    )
    shown.close()
    for host, run in zip(names, runs, strict=True):
        if not run.ok:
            raise ExokvError(f"fetching {model} onto {host}: {_why(run)}")


def _local_progress(repo: str, say: Callable[[str], None], bars: bool) -> hub.Progress:
    """Our line saying what is fetched; then huggingface_hub's bars on a terminal, else a
    line per file."""

    def progress(event: dict[str, Any]) -> None:
        if event["event"] == "plan" and event["files"]:
            size = format_size(event["bytes"], "decimal")
            say(f"downloading {len(event['files'])} files ({size}) of {repo} from {hub.endpoint()}")
        elif event["event"] == "file" and not bars:
            done, total = (format_size(event[k], "decimal") for k in ("done", "total"))
            say(f"{repo}: {event['name']} ({done} of {total})")

    return progress


def _why(run: RemoteRun) -> str:
    """A failed host's one line: its own error event, else ssh's or the run's reason."""
    for line in reversed(run.stdout.splitlines()):
        event = _event(line)
        if event and event.get("event") == "error":
            return str(event.get("message", "failed"))
    if run.error:
        return run.error
    lines = [x.strip() for x in run.stderr.splitlines() if x.strip()]
    return lines[-1][:300] if lines else f"exited with code {run.returncode}"


def _event(line: str) -> dict[str, Any] | None:
    try:
        event = json.loads(line)
    except ValueError:
        return None
    return event if isinstance(event, dict) else None


class _HostProgress:
    """Each host's fetch as it goes: rich bars on a terminal, else a line per step."""

    def __init__(self, repo: str, hosts: list[str], say: Callable[[str], None]) -> None:
        self.repo, self.hosts, self.say = repo, hosts, say
        self.bars: Any = None
        self.tasks: dict[int, Any] = {}
        if sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn

            self.bars = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                DownloadColumn(),
                console=Console(stderr=True),
                transient=False,
            )
            self.bars.start()
            # Lines go above the bars while they run, not through them.
            self.say = lambda text: self.bars.console.print(f"exokv: {text}", highlight=False)

    def line(self, i: int, text: str) -> None:
        event = _event(text)
        if event is None:
            return
        host, kind = self.hosts[i], event.get("event")
        if kind == "plan" and event.get("files"):
            size = format_size(int(event.get("bytes", 0)), "decimal")
            if self.bars is not None:
                self.tasks[i] = self.bars.add_task(f"{host}", total=event.get("bytes") or None)
            else:
                self.say(f"{host}: fetching {len(event['files'])} files ({size}) of {self.repo}")
        elif kind in ("bytes", "file") and i in self.tasks:
            self.bars.update(self.tasks[i], completed=event.get("done", 0))
        elif kind == "done":
            fetched = event.get("fetched") or []
            if i in self.tasks:
                self.bars.update(self.tasks[i], completed=event.get("bytes", 0))
            what = (
                f"fetched {len(fetched)} ({format_size(int(event.get('bytes', 0)), 'decimal')})"
                if fetched
                else "nothing to fetch"
            )
            if i not in self.tasks:  # a bar says it on a terminal
                self.say(f"{host}: has the {len(event.get('files', []))} files it needs ({what})")

    def close(self) -> None:
        if self.bars is not None:
            self.bars.stop()
