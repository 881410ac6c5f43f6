"""One rank of a distributed chat: `python -m exokv.rank.main OPTIONS`, started by mlx.launch.

OPTIONS is one word, the chat's options as the launch settled them (an
`exokv.core.options.RankOptions`), the same for every rank; its engine's options are
read from it in `exokv.rank.options`.

Every rank loads its shard of the model and runs the same Engine. Rank 0 alone
talks to the front end over the channel: it reads one request, broadcasts it to
the other ranks (one broadcast per turn), and streams the reply back. A stop
request is noted by a reader thread on rank 0 and agreed by all ranks through
the engine's per-token `group.any`, so every rank stops at the same token and
the caches stay identical.

Ranks never read the user's input. The launcher's standard input is a pipe from
the front end, and rank 0 reads exactly one bootstrap line from it (the channel
address and token), so the token is never on a command line or in the
environment.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from exokv.config import TEST_FAIL_AT, TEST_HOOKS, exokv_home, rank_log_enabled
from exokv.core.options import RankOptions
from exokv.core.records import CacheFileReport
from exokv.errors import ExokvError, PromptTooLong
from exokv.launch.command import remove_scratch
from exokv.launch.watcher import alive
from exokv.rank import kvsave
from exokv.rank.boot import (
    HEARTBEAT_S,
    beat_loaded,
    launcher_rank,
    read_bootstrap,
    release_stdin,
    report_error,
    start_beating,
)
from exokv.rank.joins import JoinBox
from exokv.rank.textflow import TextFlow
from exokv.rank.typeahead import DraftFeed
from exokv.wire import channel, messages
from exokv.wire.messages import (
    Batch,
    Draft,
    Drafted,
    DraftStep,
    Heartbeat,
    Held,
    Join,
    Message,
    Progress,
    Ready,
    Report,
    RequestId,
    Result,
    Save,
    Seen,
    Shutdown,
    Status,
    Stop,
    Turn,
    TurnRefused,
)
from exokv.wire.wake import Doorbell

if TYPE_CHECKING:
    from exokv.collectives import Group

# Tests only: "RANK:PHASE" (PHASE prefill, decode or insert) makes that rank raise there.


class CountingGroup:
    """A Group that counts and times each kind of collective, for the per-rank log."""

    def __init__(self, inner: Group) -> None:
        self.inner = inner
        self.rank = inner.rank
        self.size = inner.size
        self.counts = {"gather": 0, "any": 0, "broadcast": 0}
        self.seconds = {"gather": 0.0, "any": 0.0, "broadcast": 0.0}
        # Crossed before each stop check (exokv.wire.wake.Doorbell.cross, once it is up).
        self.bell: Callable[[], None] | None = None

    def gather(self, values: list[int]) -> list[list[int]]:
        return self._timed("gather", self.inner.gather, values)

    def any(self, flag: bool) -> bool:
        tic = time.perf_counter()
        try:
            self._wait_for_rank_0()
            return self.inner.any(flag)
        finally:
            self._count("any", tic)

    def any_with(self, flag: bool, value: int) -> tuple[bool, int]:
        # The turn's stop check, carrying rank 0's prefill step size: counted as a stop.
        tic = time.perf_counter()
        try:
            self._wait_for_rank_0()
            return self.inner.any_with(flag, value)
        finally:
            self._count("any", tic)

    def any_with_values(self, flag: bool, values: list[int]) -> tuple[bool, list[int]]:
        # A speculative decoding step's stop check, carrying rank 0's draft: a stop.
        tic = time.perf_counter()
        try:
            self._wait_for_rank_0()
            return self.inner.any_with_values(flag, values)
        finally:
            self._count("any", tic)

    def _wait_for_rank_0(self) -> None:
        """A stop check follows rank 0's share of the work (on a pipeline, its layers of
        the step), which the other ranks wait for: asleep on the doorbell, not spinning
        in the collective, where they took a core from rank 0 on a shared machine."""
        if self.bell is not None:
            self.bell()

    def broadcast(self, obj: Any) -> Any:
        return self._timed("broadcast", self.inner.broadcast, obj)

    def _timed(self, kind: str, collective: Callable[[Any], Any], arg: Any) -> Any:
        tic = time.perf_counter()
        try:
            return collective(arg)
        finally:
            self._count(kind, tic)

    def _count(self, kind: str, tic: float) -> None:
        self.counts[kind] += 1
        self.seconds[kind] += time.perf_counter() - tic


def read_options(argv: list[str] | None = None) -> RankOptions:
    """The one word every rank is started with (exokv.core.options.RankOptions)."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        if len(argv) != 1:
            raise ValueError(f"{len(argv)} arguments")
        return RankOptions.from_arg(argv[0])
    except (ValueError, TypeError, KeyError) as err:
        # The front end of this very version writes it: anything else is a usage slip.
        print(f"exokv.rank.main: expected one RankOptions word ({err})", file=sys.stderr)
        raise SystemExit(2) from None


def main(argv: list[str] | None = None) -> int:
    options = read_options(argv)
    rank = launcher_rank()
    link: channel.Connection | None = None
    # Beating (and watching the front end) from before the ring forms: a front end
    # killed while the ranks start must not leave them waiting for each other.
    start_beating(rank, options.front_end_pid)
    try:
        # Before the ring: until every rank has let its stdin go, the launcher spins.
        boot = read_bootstrap() if rank == 0 else None
        release_stdin()
        world = _join(options)
        rank = world.rank()
        if boot is not None:
            link = channel.connect(boot["addresses"], boot["token"], {"ranks": world.size()})
        return Rank(options, world, link).run()
    except Exception as err:  # noqa: BLE001 - every failure becomes one line for the front end
        report_error(rank, err, link)
        return 1
    finally:
        if options.front_end_pid is not None and not alive(options.front_end_pid):
            remove_scratch()  # the front end was killed: nobody else will


def _join(options: RankOptions) -> mx.distributed.Group:
    """This rank's group. One rank alone on a host of a hostfile (a session moved to one
    Mac, a re-plan that left one) is a group of one: mlx.launch's ring writes that rank
    an empty ring description, which the backend cannot read."""
    if options.cluster.rank_count == 1:
        os.environ.pop("MLX_HOSTFILE", None)  # else the backend reads it, and fails
        return mx.distributed.init()
    return mx.distributed.init(backend=options.cluster.backend, strict=True)


def load_shard(name: str, world: mx.distributed.Group, parallel: str, split: list[int] | None):
    """This rank's shard of the model and the tokenizer, every weight it needs checked.

    Pipeline: mlx-lm's own pipeline where the family has one, else exokv's generic
    one (exokv/model/pipeline.py). Tensor: mlx-lm's ``shard()``.
    """
    # mlx-lm and the model's files: after the heartbeat has started (see `Rank.run`).
    from exokv.model.loading import load_checkpoint
    from exokv.model.resolve import resolve_model

    # resolve_model only returns a model that is all here, so nothing is downloaded.
    model, tokenizer = load_checkpoint(Path(resolve_model(name)), world, parallel, split)
    mx.eval(mx.distributed.all_sum(mx.array(1.0), group=world, stream=mx.cpu))
    return model, tokenizer


def inject_failure(engine: Any, rank: int, spec: str) -> None:
    """Tests only (EXOKV_TEST_FAIL_AT): make `engine` raise on `rank` when the turn reaches a
    phase, as a real failure there would (a full disk, memory, a broken kernel)."""
    if not spec:
        return
    who, _, phase = spec.partition(":")
    methods = {"prefill": "_prefill", "decode": "_decode", "insert": "_insert"}
    if phase not in methods or not who.isdigit():
        raise ExokvError(f"{TEST_FAIL_AT.name}={spec!r}: use RANK:{'|'.join(methods)}")
    if int(who) != rank:
        return

    def fail(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"injected failure in {phase} ({TEST_FAIL_AT.name})")

    setattr(engine, methods[phase], fail)


def in_step(group: Group, message: Message | None, step: int, turn: int) -> Message:
    """Rank 0's next message on every rank, checked to be the step this rank expects.

    Rank 0 stamps the message with its step (broadcasts so far) and turn count. A
    rank whose collectives no longer pair with rank 0's (a different number of
    calls since the last message) receives bytes from some other collective, or a
    message for another step: it stops with one line instead of decoding garbage.
    """
    stamped = None
    if group.rank == 0:
        assert message is not None
        stamped = {**messages.encode(message), "step": step, "turn_no": turn}
    try:
        got = group.broadcast(stamped)
    except (ValueError, UnicodeDecodeError) as err:
        raise ExokvError(
            f"rank {group.rank} is out of step with rank 0 at message {step} (turn {turn + 1}): "
            f"the broadcast did not decode ({type(err).__name__})"
        ) from err
    if not isinstance(got, dict) or (got.get("step"), got.get("turn_no")) != (step, turn):
        stamp = (
            (got.get("step"), got.get("turn_no"), got.get("type")) if isinstance(got, dict) else got
        )
        raise ExokvError(
            f"rank {group.rank} is out of step with rank 0: expected message {step} after turn "
            f"{turn}, got {stamp!r}"[:300]
        )
    try:
        return messages.decode(got)
    except messages.MessageError as err:
        raise ExokvError(
            f"rank {group.rank}: message {step} from rank 0 is no message: {err}"
        ) from None


class Rank:
    def __init__(
        self, options: RankOptions, world: mx.distributed.Group, link: channel.Connection | None
    ) -> None:
        self.options = options
        self.world = world
        self.rank = world.rank()
        self.link = link
        self.inbox: queue.Queue[Message] = queue.Queue()
        self.stop = threading.Event()  # the reply in hand must end (Ctrl-C)
        self.current: RequestId = None  # the front end's number for the request in hand
        self._stop_for: RequestId = None  # the request the last stop named
        self.stopped_rows: set[RequestId] = set()  # rows of a batch the front end stopped
        self.joins = JoinBox(self.inbox)  # rank 0: requests joining the batch in flight
        self._stop_lock = threading.Lock()
        self.drafts = DraftFeed(on_done=self._draft_over)  # rank 0: typed-ahead drafts
        # Rank 0: a batch's text, at the front end's pace (its `seen` messages).
        self.flow = TextFlow(link.send) if link is not None else None
        self.log_path: Path | None = None
        if rank_log_enabled():
            self.log_path = exokv_home() / "ranks" / f"rank-{self.rank}.jsonl"
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
        # What each message rank 0 broadcasts does on every rank; False ends the loop.
        self.handlers: dict[type, Callable[[Any], bool]] = {
            Turn: self._on_turn,
            Batch: self._on_batch,
            Draft: self._on_draft,
            Save: self._on_save,
            Held: self._on_held,
            Shutdown: self._on_shutdown,
        }
        self.engine: Any = None
        self.group: CountingGroup | None = None
        self.turns = 0  # turns run so far
        self._before: dict[str, int] = {}  # the collectives' counts when this step began
        self._before_s: dict[str, float] = {}  # and their seconds

    def run(self) -> int:
        if self.link is not None:
            # Liveness and commands flow while the model loads, so a slow load is not a
            # hang; and from the moment the channel is up: importing the engine (mlx-lm,
            # transformers) takes seconds, past the front end's 10 s on a loaded machine.
            threading.Thread(target=self._heartbeat, daemon=True).start()
            threading.Thread(target=self._read_channel, daemon=True).start()
            self.link.send(Status("loading the model"))
        # The engine imports mlx-lm: only now, with the heartbeat and the channel running.
        from exokv.rank.engine import Engine
        from exokv.rank.options import engine_options

        cluster = self.options.cluster
        model, tokenizer = load_shard(cluster.model, self.world, cluster.parallel, cluster.split)
        beat_loaded(self.rank)
        from exokv.collectives import MlxGroup  # mlx-lm: imported after beat() has started

        group = CountingGroup(MlxGroup(self.world))
        draft = None
        if cluster.draft_model is not None and self.rank == 0:  # its drafts go with each step
            from exokv.rank.draft_model import load_draft  # mlx-lm, as the engine above

            draft = load_draft(cluster.draft_model, tokenizer)
        engine = Engine(
            model,
            tokenizer,
            group=group,
            draft=draft,
            options=engine_options(self.options, self.rank, self._layout()),
            replies_by_text=False,  # the messages carry replies' tokens: nothing to keep
        )
        inject_failure(engine, self.rank, TEST_HOOKS.fail_at())
        self.engine, self.group = engine, group
        # Ranks other than 0 wait for each request on this, not spinning in the broadcast.
        doorbell = Doorbell.connect(group, self.options.wake_host)
        group.bell = doorbell.cross  # every rank calls each stop check alike: bytes pair up
        if cluster.parallel == "pipeline":
            model.piece_bell = doorbell.piece_bell()  # read by exokv.rank.engine.prefill
        # Startup only, not per turn: every rank's effective budget and K/V bytes per
        # token for the front end.
        rows = group.gather(
            [-1 if engine.budget is None else engine.budget, engine.bytes_per_token]
        )
        all_budgets = [row[0] for row in rows]
        if self.link is not None:
            shown = [None if b < 0 else b for b in all_budgets]
            # The notice: why the disk tier is cold, or a torn record.
            note = engine.template.note or None
            tier = engine.coord.tier
            pool = "/".join(tier.store.pool.parts[-3:]) if tier is not None else ""
            layers = [list(r) for r in engine.layer_ranges]
            self.link.send(
                Ready(
                    self.world.size(),
                    shown,
                    engine.tier_notice,
                    note,
                    pool,
                    layers,
                    kv_per_token=[row[1] for row in rows],
                    context=engine.context,
                )
            )
        for step in itertools.count(1):
            self._before, self._before_s = dict(group.counts), dict(group.seconds)
            message = self._next_message() if self.rank == 0 else None
            doorbell.cross()
            message = in_step(group, message, step, self.turns)
            handler = self.handlers.get(type(message))
            if handler is None or not handler(message):
                return 0  # shutdown, or the front end went away

    # -- the messages every rank runs --------------------------------------------

    def _on_draft(self, message: Draft) -> bool:
        """A step of prefill ahead of Enter (exokv.rank.typeahead)."""
        left = self.engine.typeahead_step(
            message.session, message.messages, message.draft, message.step_tokens
        )
        if self.rank == 0:
            drafted = self.engine.last_draft
            if self.link is not None and drafted is not None:
                self.link.send(DraftStep(drafted.session, drafted.tokens, drafted.cached))
            self.drafts.stepped(left)
        if self.log_path is not None:
            self._log_draft(self.engine, self._counts())
        return True

    def _on_save(self, message: Save) -> bool:
        self._answer(message.id, self._save(self.engine, self.group, message))
        return True

    def _on_held(self, message: Held) -> bool:
        self._answer(message.id, self._held(self.engine, self.group, message))
        return True

    def _on_batch(self, message: Batch) -> bool:
        """Several requests decoded together (exokv.rank.batch)."""
        from exokv.rank.batch import answer_batch  # mlx-lm: not before the heartbeat (`run`)

        box = self.joins if self.rank == 0 else None
        answer_batch(self.engine, message, self.link, self.stopped_rows, self.flow, box)
        return True

    def _on_shutdown(self, message: Shutdown) -> bool:
        self.engine.close()  # the disk tier keeps the cache for the next run
        return False

    def _on_turn(self, message: Turn) -> bool:
        engine, group = self.engine, self.group
        assert group is not None
        self.turns += 1
        try:
            result = engine.turn(
                message.request,
                on_text=self._send_text if self.link else None,
                on_progress=self._send_progress if self.link else None,
                # Every rank passes a should_stop (never set off rank 0): the engine
                # agrees on it with a collective, which all ranks must call alike.
                should_stop=self.stop.is_set,
            )
        except PromptTooLong as err:  # every rank alike, before any collective
            if self.link is not None:
                self.link.send(TurnRefused(self.current, str(err), err.tokens, err.context))
            return True
        # The turn ends on every rank together: a rank that failed in it has exited
        # (its error on stderr, named by the front end), so this collective fails on
        # the others instead of rank 0 reporting a reply that rank did not finish.
        group.any(False)
        if self.flow is not None:
            self.flow.flush()  # the reply's last text comes before its result
        if self.link is not None:
            self.link.send(Result(self.current, result))
        if self.log_path is not None:
            # The broadcast's time is mostly waiting for the user's next line: left out.
            gather_s = group.seconds["gather"] - self._before_s["gather"]
            self._log(self.turns, result, self._counts(), gather_s)
        return True

    def _counts(self) -> dict[str, int]:
        """The collectives of each kind since this step began."""
        assert self.group is not None
        return {k: v - self._before[k] for k, v in self.group.counts.items()}

    def _answer(self, ident: int, report: CacheFileReport) -> None:
        if self.link is not None:
            self.link.send(Report(ident, report))

    # -- /save and resuming: the disk tier (exokv.rank.kvsave) ---------------------

    def _layout(self) -> str:
        """What a rank's disk tier depends on besides the model: how the layers are spread."""
        split = self.options.cluster.split
        shown = ",".join(map(str, split)) if split else "even"
        return f"{self.options.cluster.parallel}:{self.world.size()}:{shown}"

    def _save(self, engine: Any, group: Any, message: Save) -> CacheFileReport:
        """Every rank writes its shard of the conversation's path; a write that failed on
        any rank (a full disk) makes the save fail on all of them."""

        report = kvsave.save_session(engine, message.session, message.messages)
        tier = engine.coord.tier
        failed = bool(tier is not None and report.tokens and tier.store.failed)
        rows = group.gather([1 if failed else 0])
        bad = [r for r, row in enumerate(rows) if row[0]]
        if bad:
            why = tier.store.failed if bad[0] == self.rank else "a write failed"
            report.warning = f"rank {bad[0]}: {why}"
        if tier is not None:
            report.paths = [str(tier.store.root.parent / f"rank{r}") for r in range(len(rows))]
        return report

    def _held(self, engine: Any, group: Any, message: Held) -> CacheFileReport:
        """A resumed session: how much of it the restored tree holds (the same on every
        rank: the tree is); its next turn loads that from disk."""

        return kvsave.on_disk(engine, message.session, message.messages)

    # -- rank 0 and the channel -------------------------------------------------

    def _next_message(self) -> Message:
        message = self.drafts.next(self.inbox)  # the pending draft's next step, if nothing else
        if isinstance(message, Draft):  # its size, rank 0's for every rank (exokv.rank.pace)
            message = dataclasses.replace(message, step_tokens=self.engine.draft_step_tokens())
        if isinstance(message, Turn):
            with self._stop_lock:
                self.current = message.id
                # A stop names its request: one pressed just after Enter, that arrives
                # before its turn begins, still ends it; a late one for an earlier turn
                # does not touch this one.
                if self._stop_for is not None and self._stop_for == self.current:
                    self.stop.set()
                else:
                    self.stop.clear()
        return message

    def _read_channel(self) -> None:
        assert self.link is not None
        while True:
            try:
                message = self.link.recv()
            except channel.ChannelError:
                message = None
            if message is None:
                # The front end is gone: end any reply and leave the loop on every rank.
                self.stop.set()
                if self.flow is not None:
                    self.flow.gone()
                self.inbox.put(Shutdown())
                return
            if isinstance(message, Stop):
                self.stopped_rows.add(message.id)  # a batch's row, if it is one
                with self._stop_lock:
                    self._stop_for = message.id
                    if self._stop_for == self.current:
                        self.stop.set()
            elif isinstance(message, Join):
                self.joins.put(message)
            elif isinstance(message, Seen):
                if self.flow is not None:
                    self.flow.seen(message.step)
            elif type(message) in self.handlers:
                self.inbox.put(message)

    def _draft_over(self, ident: Any) -> None:
        """Tell the front end a draft gets no more steps (a client may wait for that)."""
        if self.link is not None and ident is not None:
            self.link.send(Drafted(ident))

    def _log_draft(self, engine: Any, counts: dict[str, int]) -> None:
        """A typeahead step in this rank's log: its collectives (the events come with
        the next turn's line, as the turn reports them)."""
        assert self.log_path is not None
        line = {"rank": self.rank, "draft_step": engine.decision, "collectives": counts}
        with open(self.log_path, "a") as f:
            f.write(json.dumps(line) + "\n")

    def _heartbeat(self) -> None:
        assert self.link is not None
        while True:
            time.sleep(HEARTBEAT_S)
            try:
                self.link.send(Heartbeat())
            except ExokvError:
                return

    def _send_text(self, text: str) -> None:
        # At the front end's pace, as a batch's (exokv.rank.textflow): a front end flooded
        # with a message per token falls seconds behind, and so do the stops it sends.
        if text and self.flow is not None:
            self.flow.add(self.current, text)
            self.flow.step()

    def _send_progress(self, done: int, total: int) -> None:
        if self.link is not None:
            self.link.send(Progress(self.current, done, total))

    def _log(self, turn: int, result: Any, counts: dict[str, int], gather_s: float) -> None:
        """This rank's own record of the turn: the evidence that ranks decided alike."""
        assert self.log_path is not None
        line = {
            "rank": self.rank,
            "turn": turn,
            "decision": result.decision,
            "session": result.session,
            "collectives": counts,
            "gather_s": gather_s,  # the cache decision's one collective, wall time
            "overhead_s": result.overhead_s,
            "prefill_steps": self.engine.prefill_steps,  # rank 0's sizes, on every rank
            "events": [e.to_dict() for e in result.events],
            "rank_stats": [s.to_dict() for s in result.rank_stats],
        }
        with open(self.log_path, "a") as f:
            f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    sys.exit(main())
