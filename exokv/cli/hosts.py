"""`exokv hosts check`: every host of a hostfile asked, before a chat, what would stop it.

All hosts are asked at once, each within a time limit (exokv.hosts.facts): reached
over ssh, the same Python (major.minor) and the same exokv, mlx and mlx-lm as this
front end, memory and disk, the --model there. Then, when every host answered, the
ranks are started as a chat starts them and a few all_sums time the link between
neighbours (exokv.hosts.linktest), which also proves their ports. What is wrong comes
as one line per problem, with what to do; the exit code is 1 when there is any.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

import typer
from rich.console import Console

from exokv.core import tables
from exokv.core.sizes import format_size
from exokv.core.tables import Column
from exokv.errors import UsageError
from exokv.hosts.facts import PROBE_TIMEOUT_S, Answer, ask_hosts
from exokv.hosts.hostfile import HostList, jaccl_problems, parse_hosts, read_hostfile
from exokv.hosts.linktest import Link, measure_link
from exokv.hosts.probe import PACKAGES, HostFacts, probe
from exokv.launch.command import LOOPBACK

hosts_app = typer.Typer(
    help="Check the hosts of a hostfile before a chat: versions, memory, model, link.",
    no_args_is_help=True,
)

FRONT_END = "the front end"


@dataclass
class Problem:
    host: str  # the ssh name; "" for the ranks together (the link)
    text: str  # what is wrong and what to do, one line
    kind: str = "host"  # "ssh", "version", "model", "hostfile", "link" or "host"

    def line(self) -> str:
        return f"{self.host}: {self.text}" if self.host else self.text


@dataclass
class Report:
    """Everything the check found: the `--json` document, and what the table shows."""

    front_end: HostFacts
    host_list: HostList
    answers: list[Answer]
    link: Link | None
    problems: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        host_list = self.host_list
        return {
            "ok": self.ok,
            "backend": host_list.backend,
            "front_end": _facts_json(self.front_end),
            "hosts": [
                {
                    "host": h.ssh,
                    "ips": h.ips,
                    "reachable": a.reached,
                    "error": a.error,
                    **(_facts_json(a.facts) if a.facts is not None else {}),
                }
                for h, a in zip(host_list.hosts, self.answers, strict=True)
            ],
            "link": asdict(self.link) if self.link is not None else None,
            "problems": [asdict(p) | {"line": p.line()} for p in self.problems],
        }


def _facts_json(facts: HostFacts) -> dict[str, Any]:
    return asdict(facts)


@hosts_app.command("check")
def check(
    hostfile: str | None = typer.Option(
        None, "--hostfile", help="mlx hostfile (JSON), as mlx.distributed_config writes"
    ),
    hosts: str | None = typer.Option(None, "--hosts", help="a,b,... one rank per host"),
    model: str | None = typer.Option(
        None, "--model", "-m", help="also check that this model is on every host"
    ),
    backend: str = typer.Option("ring", "--backend", help="ring|jaccl|mpi (a hostfile's wins)"),
    starting_port: int | None = typer.Option(
        None, "--starting-port", help="first port for the link test's ranks"
    ),
    no_link: bool = typer.Option(False, "--no-link", help="skip the link test (no ranks start)"),
    timeout: float = typer.Option(
        PROBE_TIMEOUT_S, "--timeout", help="seconds each host gets to answer"
    ),
    json_out: bool = typer.Option(False, "--json", help="print one JSON document"),
) -> None:
    """Check every host: ssh, versions, memory, disk, the model, and the link between them."""
    if (hostfile is None) == (hosts is None):
        raise UsageError("give the hosts to check: --hostfile FILE or --hosts a,b")
    if timeout <= 0:
        raise UsageError(f"--timeout must be more than 0 seconds, not {timeout:g}")
    host_list = read_hostfile(hostfile) if hostfile is not None else parse_hosts(hosts or "")
    report = run_check(host_list, model, backend, starting_port, not no_link, timeout)
    if json_out:
        print(json.dumps(report.to_json(), indent=2))
    else:
        render(report, _console())
    raise typer.Exit(0 if report.ok else 1)


def run_check(
    host_list: HostList,
    model: str | None,
    backend: str = "ring",
    starting_port: int | None = None,
    link: bool = True,
    timeout: float = PROBE_TIMEOUT_S,
) -> Report:
    """Ask every host, compare with this front end, then time the link if all answered."""
    # mlx.launch runs a rank on 127.0.0.1 without ssh: so is it asked here.
    names = [None if h.ssh == LOOPBACK else h.ssh for h in host_list.hosts]
    answers = ask_hosts(names, timeout=timeout, model=model)
    front_end = probe()
    report = Report(front_end, host_list, answers, None)
    report.problems += [Problem("", x, "hostfile") for x in jaccl_problems(host_list)]
    for host, answer in zip(host_list.hosts, answers, strict=True):
        report.problems += host_problems(host.ssh, answer, front_end)
    # The ranks need every host, and the same code on each; not the model.
    ready = not any(p.kind != "model" for p in report.problems)
    if link and ready and len(host_list.hosts) > 1:
        report.link = measure_link(host_list, backend, starting_port)
        if not report.link.ok:
            report.problems.append(Problem("", f"link test: {report.link.error}", "link"))
    return report


def host_problems(host: str, answer: Answer, front_end: HostFacts) -> list[Problem]:
    """One line per thing on `host` that would stop a chat, each saying what to do."""
    if answer.facts is None:
        if not answer.reached:
            return [
                Problem(
                    host,
                    f"cannot be reached over ssh ({answer.error}): check that "
                    f"`ssh {host}` works from here without a password",
                    "ssh",
                )
            ]
        return [Problem(host, answer.error)]
    facts = answer.facts
    out = []
    here, there = _minor(front_end.python), _minor(facts.python)
    if here != there:
        out.append(
            Problem(
                host,
                f"Python {there} there, {here} on {FRONT_END}: the ranks run the same "
                f"python ({sys.executable}); install Python {here} there, with the same "
                "environment at the same path",
                "version",
            )
        )
    for name in PACKAGES:
        want, has = front_end.versions.get(name, ""), facts.versions.get(name, "")
        if want == has or not want:
            continue
        fix = f"pip install {name}=={want} there"
        if not has:
            out.append(
                Problem(
                    host, f"{name} is not installed there ({want} on {FRONT_END}): {fix}", "version"
                )
            )
        else:
            out.append(
                Problem(host, f"{name} {has} there, {want} on {FRONT_END}: {fix}", "version")
            )
    presence = facts.model
    if presence is not None and not presence.ok:
        fix = f": {presence.fix}" if presence.fix else ""
        out.append(Problem(host, f"model {presence.name}: {presence.detail}{fix}", "model"))
    return out


def _minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


# -- rendering ----------------------------------------------------------------------------

COLUMNS = [
    Column("host", "left"),
    Column("reachable", "left"),
    Column("python", "left"),
    Column("exokv", "left", priority=2),
    Column("mlx", "left"),
    Column("mlx-lm", "left", priority=1),
    Column("memory free/total", priority=1),
    Column("disk free", priority=3),
    Column("model", "left"),
    Column("link", "left"),
]


def rows(report: Report) -> list[list[str]]:
    """The table's cells, one row per host (the front end's versions are the reference)."""
    out = []
    host_list = report.host_list
    for i, (host, answer) in enumerate(zip(host_list.hosts, report.answers, strict=True)):
        reach = "yes" if answer.reached else "no"
        f = answer.facts
        if f is None:
            out.append([host.ssh, reach, *(["-"] * 7), "-"])
            continue
        memory = f"{format_size(f.memory_available)}/{format_size(f.memory_total)}"
        out.append(
            [
                host.ssh,
                reach,
                f.python,
                f.versions.get("exokv", "") or "none",
                f.versions.get("mlx", "") or "none",
                f.versions.get("mlx-lm", "") or "none",
                memory,
                format_size(f.disk_free),
                f.model.summary() if f.model is not None else "-",
                _link_cell(report, i),
            ]
        )
    return out


def _link_cell(report: Report, index: int) -> str:
    """Host i's link to the next rank: the ring's all_sum figures (see docs/hosts.md)."""
    link = report.link
    n = len(report.host_list.hosts)
    if n == 1:
        return "one host"
    if link is None:
        return "not tested"
    if not link.ok:
        return "failed"
    assert link.latency_s is not None and link.bandwidth_bytes_per_s is not None
    to = report.host_list.hosts[(index + 1) % n].ssh
    speed = format_size(link.bandwidth_bytes_per_s)
    return f"→{to} {link.latency_s * 1000:.2f} ms, {speed}/s"


def render(report: Report, console: Console) -> None:
    fe = report.front_end
    versions = ", ".join(f"{k} {v or 'none'}" for k, v in fe.versions.items())
    console.print(f"front end: Python {fe.python}, {versions}")
    console.print(tables.fit(COLUMNS, rows(report), console.width))
    link = report.link
    if link is not None and link.ok:
        assert link.latency_s is not None and link.bandwidth_bytes_per_s is not None
        console.print(
            f"link ({link.backend}, {link.ranks} ranks, ports {link.ports}): all_sum latency "
            f"{link.latency_s * 1000:.2f} ms, bandwidth {format_size(link.bandwidth_bytes_per_s)}/s"
        )
    for problem in report.problems:
        console.print(problem.line(), markup=False)
    if report.ok:
        console.print("all hosts ready", markup=False)


def _console() -> Console:
    # Piped output has no terminal width; rich's default of 80 would wrap the table.
    wide = not sys.stdout.isatty() and "COLUMNS" not in os.environ
    return Console(highlight=False, width=200 if wide else None)
