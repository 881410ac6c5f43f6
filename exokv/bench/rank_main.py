"""One rank of `exokv bench --ranks N`: `python -m exokv.bench.rank_main '<JSON>'`.

Started by mlx.launch (see `exokv.bench.ranks`). Every rank loads its shard of
the model and runs the very same runner loop: the scenarios come from a seed, so
every rank makes the same calls in the same order, which it must, because a
pipeline or tensor forward pass is itself a collective. exokv's engine gets an
`MlxGroup`, so its one gather per turn (and its stop check) is a real collective;
cold, carried and mlx-lm-lru need none beyond the model's own.

Output, all on rank 0's standard output and nowhere else (the launcher merges
every rank's stdout in chunks, so only one rank may write there): a
`PROGRESS_MARK` line per measurement and one `DOC_MARK` line with the JSON
document. Every other print of every rank goes to standard error, with the
heartbeats and the one-line error (`exokv.launch.command.ERROR_MARK`).

The JSON argument holds only the bench settings (no secrets).
"""

from __future__ import annotations

import json
import os
import sys
from typing import IO, Any

import mlx.core as mx

from exokv.rank.boot import launcher_rank, release_stdin, report_error, start_beating
from exokv.rank.main import load_shard

PROGRESS_MARK = "exokv-bench-progress "
DOC_MARK = "exokv-bench-doc "
# Per-rank lists in the document: one value per rank (the runner fills rank 0's).
PER_RANK_KEYS = (
    "peak_cache_bytes",
    "budget_peak_bytes",
    "bytes_per_token",
    "ideal_cache_bytes",
    "bytes_per_token_unquantized",
    "bytes_per_token_fp16",
    "bytes_vs_fp16",
    "working_set_bytes",
    "budget_fraction_of_working_set",
)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    rank = launcher_rank()
    out = _private_stdout()
    try:
        if len(argv) != 1:
            raise ValueError("expected one argument: the bench settings as JSON")
        settings = json.loads(argv[0])
        release_stdin()  # before the ring: until every rank has, the launcher spins
        world = mx.distributed.init(backend=settings.get("backend", "ring"), strict=True)
        rank = world.rank()
        parent = settings.get("front_end_pid")
        start_beating(rank, parent, 2)
        doc = run(settings, world, out if rank == 0 else None)
        if rank == 0:
            out.write(DOC_MARK + json.dumps(doc) + "\n")
            out.flush()
        return 0
    except Exception as err:  # noqa: BLE001 - every failure becomes one line for the front end
        report_error(rank, err, None)
        return 1


def run(settings: dict[str, Any], world: mx.distributed.Group, out: IO[str] | None) -> dict:
    """Load this rank's shard, run the bench, and merge every rank's per-rank figures."""
    # deferred: both bring mlx-lm (2 s to import), imported once the heartbeat runs and
    # stdin is released (see main); the module's top stays light for every rank's start
    from exokv.bench import runner
    from exokv.collectives import MlxGroup

    config = runner.BenchConfig.from_dict(settings["config"])
    model, tokenizer = load_shard(config.model, world, config.parallel, None)
    group = MlxGroup(world)
    progress = StreamProgress(out) if out is not None else runner.Progress()
    doc = runner.run(config, model, tokenizer, progress, group=group)
    return merge_ranks(doc, gather_json(world, per_rank_values(doc)), world.rank())


class StreamProgress:
    """The runner's progress as lines on rank 0's stdout, for the front end's bar."""

    def __init__(self, out: IO[str]) -> None:
        self.out = out

    def start(self, total: int, estimate: str = "") -> None:
        self._send({"total": total, "estimate": estimate})

    def advance(self, description: str) -> None:
        self._send({"advance": description})

    def _send(self, message: dict[str, Any]) -> None:
        self.out.write(PROGRESS_MARK + json.dumps(message) + "\n")
        self.out.flush()


# -- every rank's own figures -----------------------------------------------------------


def _per_rank_slots(doc: Any) -> list[list[Any]]:
    """The per-rank lists of the document, in a fixed walk order (the same on every rank)."""
    slots: list[list[Any]] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key in PER_RANK_KEYS and isinstance(value, list):
                    slots.append(value)
                else:
                    walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk(doc.get("scenarios", {}))
    return slots


def per_rank_values(doc: dict[str, Any]) -> list[Any]:
    """This rank's value of each per-rank list (the runner measures this rank only)."""
    return [slot[0] if slot else None for slot in _per_rank_slots(doc)]


def merge_ranks(doc: dict[str, Any], by_rank: list[list[Any]], rank: int) -> dict[str, Any]:
    """Each per-rank list becomes one value per rank, rank 0 first."""
    slots = _per_rank_slots(doc)
    for i, slot in enumerate(slots):
        slot[:] = [values[i] for values in by_rank]
    return doc


def gather_json(world: mx.distributed.Group, obj: Any) -> list[Any]:
    """Every rank's JSON-serialisable `obj`, indexed by rank (one collective pair)."""
    # deferred: mlx-lm takes 2 s to import; run() has loaded it by now, the module's top
    # stays light so a rank starts its heartbeat first
    from mlx_lm.generate import generation_stream

    data = json.dumps(obj).encode()
    size = world.size()
    lengths = mx.distributed.all_gather(
        mx.array([len(data)]), group=world, stream=generation_stream
    ).tolist()
    longest = max(lengths)
    padded = mx.array(list(data) + [0] * (longest - len(data)), dtype=mx.uint8)
    rows = mx.distributed.all_gather(padded, group=world, stream=generation_stream)
    rows = rows.reshape(size, longest).tolist()
    return [json.loads(bytes(row[:n]).decode()) for row, n in zip(rows, lengths, strict=True)]


# -- output ------------------------------------------------------------------------------


def _private_stdout() -> IO[str]:
    """A handle on the real stdout for the marked lines; fd 1 then points at stderr.

    Anything else printed to stdout (by mlx-lm, a warning, a stray print) would be
    merged into rank 0's document by the launcher; on stderr it is harmless.
    """
    out = os.fdopen(os.dup(1), "w", buffering=1)
    sys.stdout.flush()
    os.dup2(2, 1)
    return out


if __name__ == "__main__":
    sys.exit(main())
