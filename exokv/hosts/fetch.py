"""A hub model's files onto every host before the ranks load: each host only its part.

``fetch_onto_hosts`` runs just before the ranks launch. On this machine alone (one
rank, or ``-n``) it fetches what the ranks load here, with huggingface_hub's own
progress bars. With ``--hosts``/``--hostfile`` it first fetches the config and
tokenizer here (the front end tokenizes and names the model's identity, and learns
the commit the revision names, so every host fetches the same one), then runs
exokv.model.fetcher on every host at once through exokv.launch.remote, each in its
own Hugging Face cache and for its own ranks' layers, and shows each host's
progress. A host that fails ends the start with one line naming it.

A hub ``--draft-model`` is fetched the same way, whole and onto rank 0's host alone:
rank 0 loads it (exokv.rank.draft_model), the front end reads its tokenizer.

A host that cannot get the model's files itself (the hub out of its reach, a model
folder that is not there) is lent them by the hosts that have them, through this
machine (exokv.hosts.weightfiles): only the files its ranks load and it lacks, one
line saying what came from where. Only a host that cannot be lent them either ends
the start, with one line naming it, the files it lacks and why.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from exokv.core.sizes import format_size
from exokv.errors import ExokvError
from exokv.hosts.hostfile import HostList
from exokv.hosts.weightfiles import (
    Holding,
    Lent,
    Place,
    ask,
    complete,
    file_count,
    folder_place,
    held,
    lend,
    needed,
    want_from,
)
from exokv.launch.remote import RemoteRun, run_on_each
from exokv.model import hub

FETCHER = "exokv.model.fetcher"
# A host's fetch is ended after this long: a stalled download fails sooner on its own
# (huggingface_hub's read timeout); this bounds a host that never answers at all.
FETCH_TIMEOUT_S = 12 * 3600


def _say(text: str) -> None:
    print(f"exokv: {text}", file=sys.stderr, flush=True)


@dataclass
class _Job:
    """One fetcher run: `model`'s files onto `host` (its ssh name), with the fetcher's args."""

    host: str
    model: str
    args: list[str]


def fetch_onto_hosts(
    model: str,
    hosts: HostList | None,
    split: list[int] | None,
    parallel: str,
    say: Callable[[str], None] = _say,
    draft: str | None = None,
) -> None:
    """Every host holds the files of ``model`` its ranks load, and rank 0's host the whole
    of ``draft``: a hub repo (``org/name[@revision]``) fetched by each host, lent by the
    others to one that cannot; a model folder lent to a host that lacks it there; nothing
    to do for other local models (builtins, GGUF files: each host makes its own)."""
    repos = {name: hub.repo_of(name) for name in (model, draft) if name is not None}
    if hosts is not None and repos[model] is None and Path(model.strip()).expanduser().is_dir():
        _folder_onto_hosts(model, hosts, split, parallel, say)
    if not any(repos.values()):
        return
    # Every name is checked (its config and tokenizer fetched here) before any weights.
    commits = {name: _commit_here(name, model) for name in repos}
    if hosts is None:
        bars = sys.stderr.isatty()
        for name, parsed in repos.items():
            if parsed is not None:
                with _named(name, model):
                    progress = _local_progress(parsed[0], say, bars)
                    hub.fetch(*parsed, progress=progress, bars=bars)
        return
    jobs: list[_Job] = []
    if commits[model]:
        jobs += _model_jobs(model, commits[model], hosts, split, parallel)
    if draft is not None and commits[draft]:
        whole = ["--ranks", "1", "--host-ranks", "0", "--parallel", "pipeline"]
        args = ["--model", draft, "--commit", commits[draft], *whole]
        jobs.append(_Job(hosts.hosts[0].ssh, draft, args))
    shown = _HostProgress([(job.host, job.model) for job in jobs], say)
    runs = run_on_each(
        [job.host for job in jobs],
        FETCHER,
        lambda i: jobs[i].args,
        timeout=FETCH_TIMEOUT_S,
        on_line=shown.line,
        envs=hosts.envs,
    )
    shown.close()
    lacking: list[tuple[_Job, str]] = []
    for job, run in zip(jobs, runs, strict=True):
        if run.ok:
            continue
        if job.model != model or run.error:  # a draft model, or a host ssh cannot reach
            raise ExokvError(f"fetching {job.model} onto {job.host}: {_why(run)}")
        lacking.append((job, _why(run)))
    if lacking:
        parsed = repos[model]
        assert parsed is not None and commits[model] is not None
        place = Place(
            repo=parsed[0], commit=commits[model], revision=parsed[1] or hub.DEFAULT_REVISION
        )
        fetched = [j.host for j, r in zip(jobs, runs, strict=True) if r.ok and j.model == model]
        for job, why in lacking:
            _lend(job.host, place, _want_args(job.args), [*fetched, None], hosts.envs, why, say)


def _folder_onto_hosts(
    model: str, hosts: HostList, split: list[int] | None, parallel: str, say: Callable[[str], None]
) -> None:
    """A model folder on every host: each host that lacks the files its ranks load there
    (where they read it: `~` is the host's home) is lent them by the hosts that hold
    them, or by this machine."""
    place = folder_place(model)
    wants = {host: _want_args(args) for host, args in _host_args(hosts, split, parallel)}
    machines = list(wants)
    with ThreadPoolExecutor(max_workers=len(machines)) as pool:
        asked = pool.map(lambda h: ask(h, place, wants[h], hosts.envs), machines)
        holdings: dict[str | None, Holding] = dict(zip(machines, asked, strict=True))
    holdings[None] = Holding(held(place)[0])  # this machine: the folder the chat reads
    # The whole ones first: a file is copied from the first source that holds it.
    holders = sorted(
        (h for h in machines if not holdings[h].error), key=lambda h: not complete(holdings[h])
    )
    for host in machines:
        holding = holdings[host]
        # A host that does not answer is the launch's to name, in its own words.
        if not holding.error and not complete(holding):
            why = (
                "no model folder there" if holding.needed is None else "the folder there lacks them"
            )
            # This machine's copy of the model says which files the host's ranks load.
            wanted = needed(place, want_from(wants[host]))
            lent = lend(
                host, place, wants[host], [*holders, None], hosts.envs, why, holdings, wanted
            )
            _said(lent, host, say)


def _lend(
    host: str,
    place: Place,
    want_args: list[str],
    sources: list[str | None],
    envs: list[str],
    why: str,
    say: Callable[[str], None],
) -> None:
    _said(lend(host, place, want_args, sources, envs, why), host, say)


def _said(lent: Lent, host: str, say: Callable[[str], None]) -> None:
    if lent.files:
        size = format_size(lent.bytes, "decimal")
        origin = ", ".join(dict.fromkeys(lent.sources))
        took = f"in {lent.seconds:.1f} s"
        say(f"weights: {file_count(lent.files)} ({size}) copied from {origin} to {host} {took}")


@contextlib.contextmanager
def _named(name: str, model: str) -> Iterator[None]:
    """A failure to fetch the draft model says it was --draft-model's name."""
    try:
        yield
    except ExokvError as err:
        if name == model:
            raise
        raise ExokvError(f"--draft-model {name}: {err}") from None


def _commit_here(name: str, model: str) -> str | None:
    """Fetch the config and tokenizer of `name` (the model or the draft model) here, which
    the front end reads, and return the commit its revision names, which every host then
    fetches; None for a name that is no hub repo."""
    parsed = hub.repo_of(name)
    if parsed is None:
        return None
    with _named(name, model):
        return hub.fetch(*parsed, hub.Want(host_ranks=None)).commit


def _model_jobs(
    model: str, commit: str, hosts: HostList, split: list[int] | None, parallel: str
) -> list[_Job]:
    """One job per machine: the layers of its own ranks, at `commit`."""
    return [
        _Job(host, model, ["--model", model, "--commit", commit, *args])
        for host, args in _host_args(hosts, split, parallel)
    ]


def _host_args(
    hosts: HostList, split: list[int] | None, parallel: str
) -> list[tuple[str, list[str]]]:
    """Each machine and what its ranks load, as the fetcher's arguments (--ranks ...)."""
    machines: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts.hosts):
        machines.setdefault(host.ssh, []).append(rank)
    out = []
    for host, ranks in machines.items():
        args = ["--ranks", str(len(hosts.hosts)), "--host-ranks", ",".join(map(str, ranks))]
        args += ["--parallel", parallel, *(["--split", ",".join(map(str, split))] if split else [])]
        out.append((host, args))
    return out


def _want_args(args: list[str]) -> list[str]:
    """A fetcher job's arguments without the model's name (what weightfiles' `have` takes)."""
    start = args.index("--ranks")
    return args[start:]


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

    def __init__(self, jobs: list[tuple[str, str]], say: Callable[[str], None]) -> None:
        self.jobs, self.say = jobs, say  # (host, model) per fetcher run
        self.bars: Any = None
        self.tasks: dict[int, Any] = {}
        if sys.stderr.isatty():
            # deferred: rich (~0.1 s) only for bars on a terminal; every chat imports this
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
        (host, model), kind = self.jobs[i], event.get("event")
        if kind == "plan" and event.get("files"):
            size = format_size(int(event.get("bytes", 0)), "decimal")
            if self.bars is not None:
                label = f"{host} {model}"
                self.tasks[i] = self.bars.add_task(label, total=event.get("bytes") or None)
            else:
                self.say(f"{host}: fetching {len(event['files'])} files ({size}) of {model}")
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
                files = len(event.get("files", []))
                self.say(f"{host}: has the {files} files of {model} it needs ({what})")

    def close(self) -> None:
        if self.bars is not None:
            self.bars.stop()
