"""ClusterClient: the front end's handle on ranks started by mlx.launch.

It opens the channel, has its Supervisor (exokv.launch.supervise) start the launcher
in its own process group (so Ctrl-C in the terminal reaches only the front end, and
close() can end every rank at once), hands rank 0 the address and token through the
launcher's stdin (every rank's options go as one word on its command line, an
exokv.core.options.RankOptions), and then speaks with rank 0 (exokv.wire.messages): a
turn request out; text, progress and the result back; a stop when the user presses
Ctrl-C.

Failure detection, each ending in one ExokvError that names the rank and cause:
the launcher exiting, the channel closing, or a rank going quiet (every rank
prints a heartbeat every few seconds, even while the model computes, which the
Supervisor watches, and rank 0 also sends one over the channel). During a request
the waiting loop checks; in between (the user at the prompt, a script waiting for
its next line) a watcher thread does, and wakes the main thread with SIGUSR1,
whose handler raises the same one-line error there: the chat ends, exit 1,
instead of offering a prompt that cannot work. Finished turns are already in the
database.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import os
import queue
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil

from exokv.client import Client
from exokv.client.batch import cluster_turns
from exokv.client.replan import spread_kv
from exokv.client.replicate import Replicator
from exokv.config import TEST_HOOKS
from exokv.core.options import ClusterOptions, KvQuant, RankOptions
from exokv.core.records import (
    NO_CALLS,
    BatchCalls,
    CacheFileReport,
    DraftCost,
    HostState,
    RowOutcome,
    TurnRequest,
    TurnResult,
)
from exokv.errors import ExokvError, PromptTooLong, UsageError
from exokv.hosts.placement import layers_text
from exokv.hosts.replicas import default_replicas, replica_targets
from exokv.launch.command import (
    SCRATCH_PREFIX,
    LaunchPlan,
    channel_addresses,
    check_reachable,
    make_scratch,
    plan_launch,
    rank_command,
    ssh_names,
)
from exokv.launch.supervise import Cause, Supervisor
from exokv.wire import channel
from exokv.wire.messages import (
    Draft,
    Drafted,
    DraftStep,
    Heartbeat,
    Held,
    Message,
    Progress,
    RankFailed,
    Ready,
    Report,
    Result,
    Save,
    Seen,
    Shutdown,
    Status,
    Stop,
    Texts,
    Turn,
    TurnRefused,
)

CONNECT_TIMEOUT = 60.0  # launcher start + distributed init + rank 0 dialling back
# Rank 0 beats every 2 s; this stays inside the 15 s promise to notice a lost rank.
HEARTBEAT_TIMEOUT = 10.0
CONSEQUENCE = "the chat cannot go on"  # follows a cause that only says how a rank ended
_POLL_S = 0.25
REPLICA_PATIENCE_S = 60.0  # closing waits this long for the last turn's replica copies
# This front end's word for its chat, and the plans' generations: every start of the ranks
# (a restart, a re-plan) is the next one (exokv.cache.disk.take_over).
CHAT = f"{os.getpid()}-{random.randrange(16**8):08x}"
_GENERATIONS = itertools.count(1)


class ClusterClient(Client):
    """Runs turns on ranks started by mlx.launch; the same interface as LocalClient."""

    def __init__(
        self,
        opts: ClusterOptions,
        progress: Callable[[str], None] | None = None,
    ) -> None:
        self.opts = opts
        self._progress = progress  # start-up progress for the user (stderr on a terminal)
        self._init_state()
        _check_split(opts.split, opts.parallel, ranks=None)
        seed = opts.seed if opts.seed is not None else random.randrange(2**31)
        self.plan = self._plan(opts)
        self.ranks = self.plan.ranks
        self._supervisor = Supervisor(self.plan, HEARTBEAT_TIMEOUT, on_beat=self._startup_beat)
        _check_split(opts.split, opts.parallel, ranks=self.ranks)
        try:
            self._launch(opts, seed)
        except BaseException:
            self.close()
            raise

    def _init_state(self) -> None:
        """What the client keeps, before the ranks start: start-up, link, requests, drafts."""
        self._started = time.monotonic()
        self._up: set[int] = set()  # ranks whose first beat came
        self._loaded: set[int] = set()  # ranks that said their shard is loaded
        self._ready = False
        self._closed = False
        self._state = threading.Lock()  # _closed and failure, between the watcher and main
        self._busy = 0  # requests in flight: their own waiting loop watches the ranks
        self.cause: Cause | None = None  # why the ranks are gone, once they are
        self.failure: str | None = None  # the same as the chat says it
        self._raised = False
        self._supervisor: Supervisor | None = None
        self._server: channel.ChannelServer | None = None
        self._link: channel.Connection | None = None
        self._inbox: queue.Queue[Message | None] = queue.Queue()
        self._last_seen = time.monotonic()
        self._link_lost = False
        self._budgets: list[int | None] = []
        self._kv_per_token: list[int] = []
        self._context: int | None = None
        self._template_said = False  # the fallback template's line, said once
        self._ids = 0  # numbers requests, so answers to an abandoned one are recognised
        self._turn: int | None = None  # the number of the latest turn request
        self._rows: Any = None  # the batch in flight (exokv.client.batch.BatchRows)
        self._slow_texts = TEST_HOOKS.slow_texts()  # tests only: a front end that lags
        self._draft_ids = itertools.count(1)  # "draft-N": never a request's number
        self._drafts_over = threading.Condition()
        self._draft_over = 0  # the latest draft rank 0 said gets no more steps
        self._draft_cost: DraftCost | None = None  # rank 0's word on the last draft step
        self.generation = next(_GENERATIONS)  # of the plan these ranks run (CHAT's)
        self.replicator: Replicator | None = None  # copies each turn's files (with a tier)
        self.tier_pool = ""  # the disk tier's pool under each host's kv/ ("" without one)
        self.layer_ranges: list[list[int]] = []  # every rank's [start, end) layers

    def _plan(self, opts: ClusterOptions) -> LaunchPlan:
        """The launch (exokv.launch.command), with its scratch folder made."""
        # The launcher's temporary files (a pid file and a hostfile per rank, made with
        # mktemp) go to a folder of ours, removed on close: nothing is left in /tmp.
        _sweep_scratch()
        self._scratch = make_scratch()
        try:
            return plan_launch(
                rank_command(),
                ranks=opts.ranks,
                hosts=opts.hosts,
                backend=opts.backend,
                starting_port=opts.starting_port,
                scratch=self._scratch,
            )
        except BaseException:
            shutil.rmtree(self._scratch, ignore_errors=True)
            raise

    def _launch(self, opts: ClusterOptions, seed: int) -> None:
        """Check the model (here) or the hosts (elsewhere), then start the ranks."""
        if self.plan.local:
            self._prepare_model(opts.model, opts.split)
        else:
            check_reachable(self.plan)
            # Each host's disk tier files of the layers it now runs, from the others.
            spread_kv(opts, say=_say_line)
        self.plan.argv.append(self._rank_options(opts, seed).to_arg())
        self._started = time.monotonic()
        self._say(f"starting {self.ranks} ranks…")
        self._start()

    # -- the client interface ---------------------------------------------------

    @property
    def budgets(self) -> list[int | None]:
        return list(self._budgets)

    @property
    def kv_per_token(self) -> list[int]:
        return list(self._kv_per_token)

    @property
    def model_context(self) -> int | None:
        return self._context

    def turn(
        self,
        request: TurnRequest,
        on_text: Callable[[str], None] | None = None,
        on_progress: Callable[[int, int], None] | None = None,
    ) -> TurnResult:
        with self._in_flight():
            result = self._run_turn(request, on_text, on_progress)
        self._replicate(result)
        return result

    def _replicate(self, result: TurnResult) -> None:
        """The copies that ended since the last turn in `result`'s figures; this turn's
        new files queued for their replicas."""
        if self.replicator is None:
            return
        cost = self.replicator.take()
        result.replica_bytes, result.replica_s = cost.bytes, round(cost.seconds, 3)
        result.replica_error = cost.error
        self.replicator.after_turn(result.disk_written)

    def _run_turn(
        self,
        request: TurnRequest,
        on_text: Callable[[str], None] | None,
        on_progress: Callable[[int, int], None] | None,
    ) -> TurnResult:
        ident = self._new_id()
        self._turn = ident
        self._send(Turn(ident, request))
        interrupted = False
        while True:
            try:
                message = self._next(ident)
                if isinstance(message, Texts) and on_text is not None:  # exokv.rank.textflow
                    for owner, piece in message.pieces:
                        if owner == ident:
                            on_text(str(piece))
                elif isinstance(message, Progress) and on_progress is not None:
                    on_progress(message.done, message.total)
                elif isinstance(message, TurnRefused):  # a prompt over the model's context
                    raise PromptTooLong(
                        message.message, tokens=message.tokens, context=message.context
                    )
                elif isinstance(message, Result):
                    if interrupted:
                        raise KeyboardInterrupt
                    return message.result
            except KeyboardInterrupt:
                if interrupted:
                    self.close(graceful=False)  # a second Ctrl-C: give up on the ranks
                    raise
                # Stop the reply on every rank, then wait for the ranks to finish the turn
                # so the caches stay the same everywhere; then let the caller see Ctrl-C.
                interrupted = True
                self.stop()

    def turns(
        self,
        requests: list[TurnRequest],
        calls: BatchCalls = NO_CALLS,
    ) -> list[RowOutcome]:
        outcomes = cluster_turns(self, requests, calls)
        for outcome in outcomes:
            if outcome.result is not None:
                self._replicate(outcome.result)
        return outcomes

    def stop_row(self, row: int) -> None:
        """End row `row` of the batch in flight at its next decode step, on every rank."""
        rows = self._rows
        if rows is not None:
            rows.stop(row)

    def stop(self) -> None:
        """Ask the reply being generated to end at the next token, on every rank.

        Sent from a thread of its own: this is called from SIGINT handlers, which may
        interrupt this very thread in the middle of sending (and holding the lock).
        """

        ident = self._turn
        if ident is not None:
            threading.Thread(target=self._send_stop, args=(ident,), daemon=True).start()

    def stop_now(self) -> None:
        """As `stop`, sent from this thread before returning; never from a signal handler.
        A server's event loop calls this: starting a thread there was seen to hold the loop
        up for 10 s while the front end's other threads were busy (the new thread did not
        get the GIL), and the reply ran on to its max_tokens meanwhile."""
        if self._turn is not None:
            self._send_stop(self._turn)

    def release_thread(self) -> None:
        """Nothing to free: the model runs in the ranks, not in this process."""

    def _send_stop(self, ident: int) -> None:
        try:
            self._send(Stop(ident), fail=False)
        except ExokvError:
            pass

    def draft(
        self, session: str, messages: list[dict[str, str]], text: str, wait: bool = False
    ) -> None:
        """Send the draft to rank 0, which steps it while nothing else waits (rank/main.py).
        Called from the REPL's draft thread: a failure here is the next request's to say."""
        number = next(self._draft_ids)
        try:
            self._send(Draft(f"draft-{number}", session, list(messages), text), fail=False)
        except ExokvError:  # the channel's errors too
            return
        if wait:
            with self._drafts_over:
                while self._draft_over < number and not (self.failure or self._closed):
                    self._drafts_over.wait(_POLL_S)

    def draft_cost(self, session: str) -> DraftCost | None:
        cost = self._draft_cost
        return cost if cost is not None and cost.session == session else None

    def _drafted(self, ident: Any) -> None:
        number = str(ident).removeprefix("draft-")
        with self._drafts_over:
            self._draft_over = max(self._draft_over, int(number) if number.isdigit() else 0)
            self._drafts_over.notify_all()

    # -- /save and resuming (exokv.rank.kvsave): every rank's disk tier --------------

    def save_cache(self, session: str, messages: list[dict[str, str]]) -> CacheFileReport:
        """Write the conversation's cached path to every rank's disk tier."""
        return self._report(Save, session, messages)

    def cache_held(self, session: str, messages: list[dict[str, str]]) -> CacheFileReport:
        """How much of a resumed conversation the ranks' restored tree holds."""
        return self._report(Held, session, messages)

    def _report(
        self, ask: type[Save] | type[Held], session: str, messages: list[dict[str, str]]
    ) -> CacheFileReport:
        with self._in_flight():
            ident = self._new_id()
            self._send(ask(ident, session, messages))
            while True:
                reply = self._next(ident)
                if isinstance(reply, Report):
                    return reply.report

    @contextlib.contextmanager
    def _in_flight(self) -> Iterator[None]:
        with self._state:
            self._busy += 1
        if self.replicator is not None:  # no replica copy while the ranks work
            self.replicator.busy(True)
        try:
            yield
        finally:
            with self._state:
                self._busy -= 1
                idle = self._busy == 0
            if idle and self.replicator is not None:
                self.replicator.busy(False)

    def health(self) -> str | None:
        return self.failure  # no restarts: a failure ends the server

    def hosts(self) -> list[HostState]:
        """Each host with its ranks and their layers (every rank's, from rank 0's Ready)."""
        if self.opts.hosts is None:
            return []
        out: dict[str, HostState] = {}
        for rank, host in enumerate(self.plan.hosts):
            state = out.setdefault(host.ssh, HostState(host.ssh, "up"))
            state.ranks.append(rank)
            if rank < len(self.layer_ranges) and self.opts.parallel == "pipeline":
                shown = layers_text(self.layer_ranges[rank])
                state.layers = f"{state.layers}, {shown}" if state.layers else shown
        return list(out.values())

    def change_hosts(self, add: str | None = None, drop: str | None = None) -> str:
        raise ExokvError(
            "with --restarts 0 the ranks are never started again: /hosts add and drop "
            "need --restarts 1 or more"
        )

    def close(self, graceful: bool = True) -> None:
        """End the ranks: a clean shutdown first (if `graceful`), then the whole process group."""
        with self._state:
            if self._closed:
                return
            self._closed = True
        graceful = graceful and self._link is not None
        if self.replicator is not None:  # the last turn's replicas, before the chat ends
            self.replicator.close(REPLICA_PATIENCE_S if graceful else 0.0)
        if graceful:
            try:
                self._link.send(Shutdown())  # type: ignore[union-attr]
            except ExokvError:
                graceful = False
        if self._supervisor is not None:
            # With a disk tier the ranks spill what RAM holds and persist it: more time.
            patience = 60.0 if self.opts.disk_budget not in (None, 0) else 5.0
            self._supervisor.end(patience if graceful else 0.0)
        if self._link is not None:
            self._link.close()
        if self._server is not None:
            self._server.close()
        shutil.rmtree(self._scratch, ignore_errors=True)

    @property
    def refused(self) -> list[str]:
        """Why each stray connection to the channel was refused."""
        return list(self._server.refused) if self._server else []

    # -- starting ---------------------------------------------------------------

    def _say(self, text: str) -> None:
        if self._progress is not None and not self._ready:
            self._progress(text)

    def _startup_beat(self, rank: int, loaded: bool) -> None:
        """Start-up progress from the ranks' beats: each rank up, then its shard loaded."""
        took = time.monotonic() - self._started
        if loaded and rank not in self._loaded:
            self._loaded.add(rank)
            self._say(f"rank {rank} loaded its part of the model ({took:.1f} s)")
        elif not loaded and rank not in self._up:
            self._up.add(rank)
            self._say(f"rank {rank} is up ({took:.1f} s)")

    def _say_ready(self) -> None:
        # The ranks' last lines come through the launcher in its own time: give them a
        # moment, so "ready" is the last line before the banner.
        deadline = time.monotonic() + 1.0
        while len(self._loaded) < self.ranks and time.monotonic() < deadline:
            time.sleep(0.02)
        self._say(f"ready in {time.monotonic() - self._started:.1f} s")
        self._ready = True

    def _prepare_model(self, name: str, split: list[int] | None) -> None:
        """Resolve (and for builtins, generate) the model once, before the ranks race to."""
        # These import mlx (a builtin is generated with it): only for ranks on this machine.
        from exokv.model.families import check_parallel
        from exokv.model.resolve import resolve_model

        path = resolve_model(name)
        try:
            config = json.loads((path / "config.json").read_text())
        except (OSError, ValueError):
            return
        check_parallel(config, self.opts.parallel, self.ranks)  # before any rank starts
        layers = config.get("num_hidden_layers")
        if split is not None and isinstance(layers, int) and sum(split) != layers:
            raise UsageError(f"--split adds up to {sum(split)} layers; the model has {layers}")
        if isinstance(layers, int) and self.ranks > layers and self.opts.parallel == "pipeline":
            raise UsageError(
                f"-n {self.ranks}: the model has {layers} layers, at most one rank per layer"
            )
        heads = config.get("num_key_value_heads") or config.get("num_attention_heads")
        if self.opts.parallel == "tensor" and isinstance(heads, int) and heads % self.ranks:
            raise UsageError(
                f"--parallel tensor splits attention heads: {heads} KV heads do not divide "
                f"among {self.ranks} ranks; use --parallel pipeline or another -n"
            )

    def _rank_options(self, opts: ClusterOptions, seed: int) -> RankOptions:
        """The one record every rank starts with, as this launch settled it."""
        settled = dataclasses.replace(
            opts,
            seed=seed,  # drawn here when none was given: the same on every rank
            backend=self.plan.backend,  # a hostfile's own wins over --backend
            # The ranks' tier directory names the group size only with --kv-bits, as the
            # ranks have always had it (a rank in this process names the one given).
            kv=opts.kv if opts.kv.bits is not None else KvQuant(),
        )
        first = self.plan.hosts[0]
        local = self.plan.local  # a pid means nothing on another host
        return RankOptions(
            settled,
            ranks_here=self.ranks if local else 1,  # they share this machine's RAM
            front_end_pid=os.getpid() if local else None,
            wake_host=first.ips[0] if first.ips else first.ssh,
            replica_targets=tuple(self._replica_targets(opts)),
            plan_chat=CHAT,
            plan_generation=self.generation,
        )

    def _rank_hosts(self) -> list[str | None]:
        """Each rank's ssh name (None: this machine)."""
        return ssh_names(self.plan.hosts)

    def _replica_targets(self, opts: ClusterOptions) -> list[int | None]:
        """Where each rank's files are copied (exokv.hosts.replicas): a pipeline's, over
        several hosts, with a disk tier (tensor ranks hold slices no other layout reads)."""
        hosts = self._rank_hosts()
        wanted = opts.replicas if opts.replicas is not None else default_replicas(hosts)
        if opts.parallel != "pipeline" or opts.disk_budget is None:
            wanted = 0
        return replica_targets(hosts, wanted)

    def _start(self) -> None:
        plan: LaunchPlan = self.plan
        self._server = channel.ChannelServer(plan.bind_host)
        boot = {
            "addresses": channel_addresses(plan, self._server.port),
            "token": self._server.token,
        }
        ranks = self._supervisor
        assert ranks is not None
        # The launcher forwards its stdin to every rank; rank 0 reads this one line.
        ranks.start(
            env={**os.environ, "TMPDIR": str(self._scratch)},
            first_line=json.dumps(boot),
            secret=self._server.token,
        )
        deadline = time.monotonic() + CONNECT_TIMEOUT
        while self._link is None:
            self._link = self._server.wait(_POLL_S)
            if self._link is None and ranks.poll() is not None:
                self._fail("the ranks stopped before rank 0 connected")
            if time.monotonic() > deadline:
                self._fail(f"rank 0 did not connect within {CONNECT_TIMEOUT:.0f} s")
        self._last_seen = time.monotonic()
        ranks.expect_beats()
        threading.Thread(target=self._read_link, daemon=True).start()
        while True:
            message = self._next()
            if isinstance(message, Ready):
                if self._progress is not None:
                    self._say_ready()
                self._budgets = list(message.budgets)
                self._kv_per_token, self._context = list(message.kv_per_token), message.context
                self._start_replicas(message)
                if message.notice:  # the ranks' stderr is not the user's
                    print(f"exokv: disk tier: {message.notice}", file=sys.stderr)
                if message.template_note and not self._template_said:
                    print(f"exokv: {message.template_note}", file=sys.stderr)
                    self._template_said = True
                ranks.ranks_ready()  # every rank is past release_stdin by now
                break
        if threading.current_thread() is threading.main_thread():
            # Never restored: a wake-up still pending after close must not kill the process.
            signal.signal(signal.SIGUSR1, self._raise_failure)
        threading.Thread(target=self._watch, name="exokv-watch", daemon=True).start()

    def _start_replicas(self, ready: Ready) -> None:
        self.tier_pool, self.layer_ranges = ready.tier_pool, list(ready.layers)
        targets = self._replica_targets(self.opts)
        if ready.tier_pool and any(t is not None for t in targets):
            envs = self.opts.hosts.envs if self.opts.hosts is not None else []
            hosts = self._rank_hosts()
            self.replicator = Replicator(hosts, targets, ready.layers, ready.tier_pool, envs)

    # -- between requests: the watcher ---------------------------------------------

    def _watch(self) -> None:
        """Check the ranks while no request is waiting on them; on a failure, end the
        chat from the main thread (see the module docstring)."""
        main = threading.main_thread()
        while not self._closed:
            time.sleep(_POLL_S)
            with self._state:
                if self._busy or self._closed:
                    continue
            trouble, settle = self._trouble()
            if trouble is None:
                continue
            cause = self._diagnose(trouble, settle)
            with self._state:
                if self._closed or self._busy:
                    continue  # quitting anyway, or a request that will see it itself
                self.cause, self.failure = cause, cause.worded(CONSEQUENCE)
            self.close(graceful=False)
            if main.is_alive() and signal.getsignal(signal.SIGUSR1) == self._raise_failure:
                signal.pthread_kill(main.ident, signal.SIGUSR1)  # type: ignore[arg-type]
            return

    def _raise_failure(self, signum: int, frame: Any) -> None:
        if self.failure and not self._raised:
            self._raised = True  # said once: later requests get it from _send
            raise ExokvError(self.failure)

    # -- receiving and failure detection -----------------------------------------

    def _read_link(self) -> None:
        assert self._link is not None
        while True:
            try:
                message = self._link.recv()
            except channel.ChannelError:
                message = None
            self._last_seen = time.monotonic()
            if isinstance(message, Drafted):
                self._drafted(message.id)
                continue
            if isinstance(message, DraftStep):
                self._draft_cost = DraftCost(message.session, message.tokens, message.cached)
                continue
            if message is None:
                self._link_lost = True
            self._inbox.put(message)
            if message is None:
                return

    def _new_id(self) -> int:
        self._ids += 1
        return self._ids

    def _next(self, ident: int | None = None, idle: bool = False) -> Message | None:
        """The next message from rank 0 about request `ident`, or an ExokvError when the
        ranks fail. Messages about an earlier request (one whose caller gave up, say on
        an exception in on_text) are dropped, so the channel never gets out of step.
        With `idle`, None when nothing came for a poll's time or `nudge` was called."""
        while True:
            try:
                message = self._inbox.get(timeout=_POLL_S)
            except queue.Empty:
                message = _IDLE
            if message is None:
                self._fail("rank 0 closed the channel")
            if isinstance(message, RankFailed):
                self._fail(f"rank {message.rank}: {message.message}")
            if isinstance(message, Texts):  # handled now: rank 0 may send the next
                if self._slow_texts:
                    time.sleep(self._slow_texts)
                self._seen(message)
            if not isinstance(message, (Heartbeat, Status)):
                # texts name their request in each piece (exokv.rank.textflow)
                if ident is None or isinstance(message, Texts) or _about(message) == ident:
                    return message
                continue
            cause, settle = self._trouble()
            if cause is not None:
                self._fail(cause, settle=settle)
            if idle and message is _IDLE:
                return None

    def nudge(self) -> None:
        """Wake the batch in flight's reader (a request may join it: exokv.client.batch)."""
        self._inbox.put(_IDLE)

    def _seen(self, message: Texts) -> None:
        try:
            self._send(Seen(message.step), fail=False)
        except ExokvError:  # the ranks are gone: the next read says so
            pass

    def _trouble(self) -> tuple[str | None, bool]:
        """What is wrong with the ranks now, if anything, and whether the launcher will
        say more about it (see `_fail`)."""
        if self._link_lost:
            return "rank 0 closed the channel", True
        ranks = self._supervisor
        if ranks is None:
            return None, False
        if ranks.poll() is not None:
            return "the ranks stopped", True
        return ranks.silent(channel_seen=self._last_seen), False

    def _send(self, message: Message, fail: bool = True) -> None:
        if self.failure:
            raise ExokvError(self.failure)
        if self._link is None or self._closed:
            raise ExokvError("the ranks are not running")
        try:
            self._link.send(message)
        except channel.MessageTooLarge as err:
            # Refused before a byte was sent: the ranks never saw it, the chat goes on.
            raise ExokvError(f"not sent to the ranks: {err}") from None
        except channel.ChannelError:
            if fail:
                self._fail("the channel to rank 0 broke")
            raise

    def _fail(self, trouble: str, settle: bool = True) -> None:
        """Find out which rank died and why, end everything, raise one line.

        `settle`: give the launcher a moment to notice the dead rank and say which
        it was; pointless when rank 0 hangs (nothing will exit by itself).
        """
        cause = self._diagnose(trouble, settle)
        with self._state:
            if self.cause is None:
                self.cause, self.failure = cause, cause.worded(CONSEQUENCE)
        self.close(graceful=False)
        raise ExokvError(self.failure)

    def _diagnose(self, trouble: str, settle: bool) -> Cause:
        if self._supervisor is None:
            return Cause(trouble)
        return self._supervisor.diagnose(trouble, settle)


_IDLE = Heartbeat()  # a poll of `_next` that got nothing: a time to check, as after a beat


def _about(message: Message) -> Any:
    """The request a message from rank 0 answers (None: no request's)."""
    return getattr(message, "id", None)


def _say_line(text: str) -> None:
    print(f"exokv: {text}", file=sys.stderr, flush=True)


def _check_split(split: list[int] | None, parallel: str, ranks: int | None) -> None:
    """--split is for pipelines, one value per rank (`ranks`, once the launch is planned)."""
    if split is None:
        return
    if parallel == "tensor":
        raise UsageError("--split is for --parallel pipeline (tensor splits every layer)")
    if ranks is not None and len(split) != ranks:
        raise UsageError(f"--split has {len(split)} values for {ranks} ranks")


def _sweep_scratch() -> None:
    """Remove the launcher folders of chats that were killed (the pid in the name is gone);
    their ranks remove them too when they can, but a killed front end cannot."""
    for path in Path(tempfile.gettempdir()).glob(f"{SCRATCH_PREFIX}*-*"):
        pid = path.name[len(SCRATCH_PREFIX) :].split("-", 1)[0]
        if not pid.isdigit():
            continue
        try:
            gone = psutil.Process(int(pid)).status() == psutil.STATUS_ZOMBIE
        except psutil.Error:
            gone = True
        if gone:
            shutil.rmtree(path, ignore_errors=True)
