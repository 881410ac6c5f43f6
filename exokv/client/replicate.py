"""Each turn's KV kept on two hosts: the front end copies what every rank wrote to disk
to the host that keeps its replica, behind the chat.

After a turn's reply, the ranks have written the files of the turn's new nodes
(their disk tiers' write-through, exokv.cache.disk_tier): the result names them
(`TurnResult.disk_written`). A thread of ours then copies rank r's files from its
host to the host of `targets[r]` (exokv.hosts.replicas), over ssh through this
machine (hosts may not reach each other), with exokv.hosts.kvfiles: the sender waits
for files its rank is still writing, the receiver writes each one whole or not at
all. Copies run only while no request is in flight (`busy`): one under way when the
next turn starts is ended at once and run again once that turn is over (what it had
written is whole, and skipped then), so a copy never takes the CPU or the links from
a turn's prefill or reply (measured: benchmarks/replicas.py). A copy that fails is
said in the next turn's figures, never ends the chat. The receiving
rank counts the copies against its disk budget and drops them with their nodes, as
every rank decides alike from the tree (exokv.cache.disk_tier).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from exokv.hosts.kvfiles import Copied, copy_files
from exokv.hosts.replicas import file_name

# A turn's copies wait this long, all files together, for a rank still writing them.
WRITE_WAIT_S = 30.0
COPY_TIMEOUT_S = 600.0


@dataclass
class ReplicaCost:
    """What the copies that ended since the last `take` cost: bytes, wall seconds (each
    turn's copies run together: a turn's seconds are its slowest copy's), files, and the
    last failure's line ("" when none failed)."""

    bytes: int = 0
    seconds: float = 0.0
    files: int = 0
    error: str = ""


class Replicator:
    """Copies every rank's new files to its replica's host, one turn's at a time."""

    def __init__(
        self,
        hosts: Sequence[str | None],
        targets: Sequence[int | None],
        layers: Sequence[Sequence[int]],
        pool: str,
        envs: Sequence[str] = (),
    ) -> None:
        """`hosts[r]`: rank r's ssh name; `targets[r]`: the rank whose host keeps its copy;
        `layers[r]`: its [start, end) (its files' names); `pool`: under each host's kv/."""
        self.hosts = list(hosts)
        self.targets = list(targets)
        self.layers = [(int(a), int(b)) for a, b in layers]
        self.pool = pool
        self.envs = list(envs)
        self._jobs: queue.Queue[list[int] | None] = queue.Queue()
        self._lock = threading.Lock()
        self._cost = ReplicaCost()
        self.totals = ReplicaCost()  # every copy since the start
        self._busy = threading.Event()  # a request in flight: no copy runs meanwhile
        self._idle = threading.Event()
        self._idle.set()
        self._thread = threading.Thread(target=self._run, name="exokv-replicas", daemon=True)
        self._thread.start()

    @property
    def active(self) -> bool:
        return bool(self.pool) and any(t is not None for t in self.targets)

    def after_turn(self, written: Sequence[int]) -> None:
        """Copy the files of `written` nodes (a turn's) behind the chat; returns at once."""
        if written and self.active:
            self._jobs.put(list(written))

    def busy(self, flag: bool) -> None:
        """A request starts (True) or ends (False): copies wait for the chat to be idle."""
        if flag:
            self._idle.clear()
            self._busy.set()
        else:
            self._busy.clear()
            self._idle.set()

    def take(self) -> ReplicaCost:
        """The copies that ended since the last call."""
        with self._lock:
            cost, self._cost = self._cost, ReplicaCost()
        return cost

    def wait(self, timeout: float) -> bool:
        """Wait for every queued copy to end (at most `timeout` s); whether they did."""
        done = threading.Event()
        self._jobs.put([])  # a marker: when it is taken, every job before it has ended
        threading.Thread(target=lambda: (self._jobs.join(), done.set()), daemon=True).start()
        return done.wait(timeout)

    def close(self, timeout: float) -> None:
        """End the thread once the queued copies end, waiting at most `timeout` s."""
        self.wait(timeout)
        self._jobs.put(None)

    def _run(self) -> None:
        while True:
            nodes = self._jobs.get()
            try:
                if nodes is None:
                    return
                while nodes and not self._copy_turn(nodes):
                    pass  # a request came: run it again once the chat is idle
            finally:
                self._jobs.task_done()

    def _copy_turn(self, nodes: list[int]) -> bool:
        """Every rank's files of `nodes` to its replica's host, all ranks at once, once no
        request is in flight; False when one came meanwhile (the copies were ended)."""
        self._idle.wait()
        pairs = [(s, t) for s, t in enumerate(self.targets) if t is not None]
        with ThreadPoolExecutor(max_workers=max(len(pairs), 1)) as pool:
            copies = list(pool.map(lambda st: self._copy_rank(nodes, *st), pairs))
        if any(c.cancelled for c in copies):
            return False
        with self._lock:
            for cost in (self._cost, self.totals):
                cost.bytes += sum(c.bytes for c in copies)
                cost.files += sum(c.files for c in copies)
                cost.seconds += max((c.seconds for c in copies), default=0.0)
                failed = [c.error for c in copies if c.error]
                cost.error = failed[-1] if failed else cost.error
        return True

    def _copy_rank(self, nodes: list[int], source: int, target: int) -> Copied:
        names = [file_name(n, self.layers[source]) for n in nodes]
        copied = copy_files(
            self.hosts[source],
            self.hosts[target],
            self.pool,
            names,
            self.envs,
            wait=WRITE_WAIT_S,
            timeout=COPY_TIMEOUT_S,
            cancel=self._busy,
        )
        if copied.error:
            copied.error = f"rank {source}'s replica on rank {target}'s host: {copied.error}"
        return copied
