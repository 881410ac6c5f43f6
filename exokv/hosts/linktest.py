"""The link test of `exokv hosts check`: ranks started as a chat starts them, timed.

`measure_link` plans an mlx.launch over the hosts (`exokv.launch.command.plan_launch`,
so the same hostfile, backend and ports as a chat), runs `exokv.hosts.link_main` on
every rank under a Supervisor, and returns what rank 0 measured, or one line
saying where it stopped: a rank that never started, the ring that never formed
(the ranks' ports closed between neighbours), a rank's own error. Everything it
started is ended before it returns, whatever happened.
"""

from __future__ import annotations

import json
import os
import queue
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from exokv.errors import ExokvError
from exokv.hosts.hostfile import HostList
from exokv.launch.command import SCRATCH_PREFIX, LaunchPlan, plan_launch, rank_command
from exokv.launch.supervise import Cause, Supervisor

LINK_MODULE = "exokv.hosts.link_main"
LINK_MARK = "exokv-link "  # rank 0's line with the figures (exokv.hosts.link_main prints it)
START_TIMEOUT_S = 60.0  # ssh, the launcher and python's start on every host
RING_TIMEOUT_S = 30.0  # once every rank runs: the ring forms and the all_sums finish
HEARTBEAT_TIMEOUT_S = 20.0
LATENCY_ROUNDS = 20
BANDWIDTH_BYTES = 4 * 1024 * 1024
_POLL_S = 0.25


@dataclass
class Link:
    """What the link test found: figures, or why there are none."""

    ranks: int
    backend: str
    ports: str  # "28500-28501": where the ranks listen (ring), or the coordinator's (jaccl)
    latency_s: float | None = None  # the median one-number all_sum
    bandwidth_bytes_per_s: float | None = None  # per link, over a 4 MB all_sum
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error


def measure_link(hosts: HostList, backend: str = "ring", starting_port: int | None = None) -> Link:
    """The ranks' all_sum latency and bandwidth over `hosts`; never raises for a host's fault."""
    with tempfile.TemporaryDirectory(prefix=f"{SCRATCH_PREFIX}link-") as scratch:
        try:
            plan = plan_launch(
                rank_command(module=LINK_MODULE),
                hosts=hosts,
                backend=backend,
                starting_port=starting_port,
                scratch=Path(scratch),
            )
        except ExokvError as err:
            return Link(len(hosts.hosts), backend, "", error=str(err))
        # The rank's one argument, after the planned command (as the chat's ranks get
        # theirs): the backend is the plan's, where a hostfile's own wins over ring.
        settings = {"rounds": LATENCY_ROUNDS, "bytes": BANDWIDTH_BYTES, "backend": plan.backend}
        if plan.local:
            settings["front_end_pid"] = os.getpid()  # a pid means nothing on another host
        plan.argv.append(json.dumps(settings))
        return _run(plan)


def _cause(ranks: Supervisor, trouble: str) -> Cause:
    """Why the ranks ended (a remote rank's own error included: the Supervisor reads it
    where `ssh -tt` puts it)."""
    return ranks.diagnose(trouble)


def _ports(plan: LaunchPlan) -> str:
    if plan.backend.startswith("jaccl"):
        return f"{plan.starting_port} (coordinator)"
    count = sum(max(1, len(h.ips)) for h in plan.hosts)
    return f"{plan.starting_port}-{plan.starting_port + count - 1}"


def _run(plan: LaunchPlan) -> Link:
    link = Link(plan.ranks, plan.backend, _ports(plan))
    lines: queue.Queue[str] = queue.Queue()

    def take(stream: str, line: str) -> bool:
        if stream == "stdout" and line.startswith(LINK_MARK):
            lines.put(line[len(LINK_MARK) :])
            return True
        return False

    ranks = Supervisor(plan, HEARTBEAT_TIMEOUT_S, start_timeout=START_TIMEOUT_S, on_line=take)
    try:
        ranks.start()
        all_beating: float | None = None
        while True:
            try:
                doc = json.loads(lines.get(timeout=_POLL_S))
            except queue.Empty:
                doc = None
            if doc is not None:
                link.latency_s = float(doc["latency_s"])
                link.bandwidth_bytes_per_s = float(doc["bandwidth_bytes_per_s"])
                return link
            now = time.monotonic()
            code = ranks.poll()
            if code is not None:
                ranks.drained(2.0)
                if not lines.empty():
                    continue  # the figures came just before the exit
                trouble = f"the ranks ended (launcher exit {code}) without figures"
                link.error = _cause(ranks, trouble).worded("no link figures")
                return link
            silent = ranks.silent()
            if silent is not None:
                link.error = ranks.diagnose(silent, settle=False).worded("no link figures")
                return link
            if all_beating is None and len(ranks.beats) == plan.ranks:
                all_beating = now
            if all_beating is not None and now - all_beating > RING_TIMEOUT_S:
                link.error = (
                    f"every rank started but their ring did not form within "
                    f"{RING_TIMEOUT_S:.0f} s: open ports {link.ports} between the hosts "
                    "(a firewall?) and check each host's first IP reaches its neighbours"
                )
                return link
    finally:
        ranks.end()
