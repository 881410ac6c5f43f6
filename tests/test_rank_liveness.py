"""A rank's channel heartbeat flows from the moment the channel is up (issue 18).

Rank 0 used to start its heartbeat only after importing the engine (mlx-lm and
transformers: 8 s measured between the channel's connection and the first message
with the machine loaded), and the front end ends a chat whose rank 0 is silent for
10 s. Here that import is made slow on purpose; heartbeats must flow through it.
"""

from __future__ import annotations

import subprocess
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from exokv.client.cluster import ClusterClient

SCRIPT = r"""
import sys, threading, time
from types import SimpleNamespace

from exokv.core.options import ClusterOptions, RankOptions
from exokv.rank import main as rank

SLOW_S = 1.0


class SlowEngineImport:
    # A loaded machine: importing the engine (mlx-lm, transformers) takes seconds.
    def find_spec(self, name, path=None, target=None):
        if name == "exokv.rank.engine":
            time.sleep(SLOW_S)
        return None


sys.meta_path.insert(0, SlowEngineImport())
rank.HEARTBEAT_S = 0.05
sent = []


class Link:
    def send(self, message):
        sent.append(message.TYPE)

    def recv(self):
        time.sleep(60)


class Loaded(Exception):
    pass


def load_shard(*args):
    raise Loaded


rank.load_shard = load_shard
world = SimpleNamespace(rank=lambda: 0, size=lambda: 1)
options = RankOptions(ClusterOptions(model="m"))
tic = time.monotonic()
try:
    rank.Rank(options, world, Link()).run()
except Loaded:
    pass
assert time.monotonic() - tic >= SLOW_S
print(sent.count("heartbeat"), sent[0])
"""


def test_heartbeats_flow_while_the_engine_is_imported() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    beats, first = proc.stdout.split()
    assert first == "status"
    # 1 s of import at a 0.05 s heartbeat: many, not none (a loaded machine may lose some).
    assert int(beats) >= 5


def _remote_client(beats: dict[int, float], checked: float) -> ClusterClient:
    from types import SimpleNamespace

    from exokv.client.cluster import HEARTBEAT_TIMEOUT, ClusterClient
    from exokv.launch.supervise import Supervisor

    client = object.__new__(ClusterClient)
    # Remote ranks whose hosts said nothing: only their beats count (tests/test_liveness.py
    # has the rule with the hosts' word).
    hosts = [SimpleNamespace(ssh="mac-a"), SimpleNamespace(ssh="mac-b")]
    ranks = Supervisor(SimpleNamespace(local=False, hosts=hosts), HEARTBEAT_TIMEOUT)
    client._supervisor, client._link_lost = ranks, False
    ranks.beats, client._last_seen, ranks._checked = beats, max(beats.values()), checked
    return client


def test_a_check_after_the_front_end_itself_was_not_run_waits_for_the_next() -> None:
    """A front end unscheduled for longer than the heartbeat timeout (a paused or loaded
    machine) wakes with beats unread in its pipes: the first check after such a gap
    does not judge; the next, after the readers had their turn, does."""
    import time

    from exokv.client.cluster import HEARTBEAT_TIMEOUT
    from exokv.launch.supervise import _SELF_STALL_S

    now = time.monotonic()
    stale = {0: now, 1: now - HEARTBEAT_TIMEOUT - 5}
    client = _remote_client(stale, checked=now - _SELF_STALL_S - 1)
    assert client._trouble() == (None, False)  # the front end was the one not running
    cause, _ = client._trouble()  # checked a moment ago: rank 1 really is silent
    assert cause is not None and cause.startswith("rank 1 stopped responding")
    # Checks at the usual pace judge at once.
    client = _remote_client(stale, checked=time.monotonic())
    assert client._trouble()[0] is not None
