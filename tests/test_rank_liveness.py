"""A rank's channel heartbeat flows from the moment the channel is up (issue 18).

Rank 0 used to start its heartbeat only after importing the engine (mlx-lm and
transformers: 8 s measured between the channel's connection and the first message
with the machine loaded), and the front end ends a chat whose rank 0 is silent for
10 s. Here that import is made slow on purpose; heartbeats must flow through it.
"""

from __future__ import annotations

import subprocess
import sys

SCRIPT = r"""
import sys, threading, time
from types import SimpleNamespace

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
        sent.append(message["type"])

    def recv(self):
        time.sleep(60)


class Loaded(Exception):
    pass


def load_shard(*args):
    raise Loaded


rank.load_shard = load_shard
world = SimpleNamespace(rank=lambda: 0, size=lambda: 1)
args = SimpleNamespace(split=None, model="m", parallel="pipeline")
tic = time.monotonic()
try:
    rank.Rank(args, world, Link()).run()
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
