"""`exokv cache ...`: read the state store and render tables or JSON.

Every command reads one snapshot of the database, so it can run while a chat
writes in another terminal; none of them creates a database that is not there.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import typer
from rich.console import Console
from rich.text import Text

from exokv.config import exokv_home
from exokv.core import tables
from exokv.core.sizes import format_size
from exokv.core.tables import Column
from exokv.errors import ExokvError, UsageError
from exokv.state import Store, caches_dir, clear_saved_caches, queries, running_chats

cache_app = typer.Typer(
    help="Inspect the prefix cache: stats, entries, pressure, evictions.",
    no_args_is_help=True,
)

JSON_HELP = "Print one JSON document instead of a table."
NO_SESSIONS = "No sessions yet: start one with `exokv chat`."
NO_CACHE = "No cache activity recorded yet: it appears after the next `exokv chat` turn."
# An entry's hits are the tree's own count, which the disk tier keeps across chats, while
# `cache stats` counts the current run's turns: said under the table, as the two differ.
ENTRY_HITS = (
    "Hits: the turns that reused the entry since it was cached, over every chat that kept it "
    "(the disk tier keeps entries across chats); `cache stats` counts this run's turns."
)
_SPARKS = "▁▂▃▄▅▆▇█"
_SINCE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|sec|secs|m|min|mins|h|hr|hrs|d|day|days|w)\s*$")
_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_since(text: str, now: float | None = None) -> float:
    """'90s', '30m', '1h', '2d', '1w' -> the epoch time that long ago."""
    match = _SINCE.match(text.lower())
    if not match:
        raise UsageError(f"invalid --since {text!r}: use a duration like 90s, 30m, 1h, 2d or 1w")
    seconds = float(match.group(1)) * _SECONDS[match.group(2)[0]]
    return (time.time() if now is None else now) - seconds


def _at_least(name: str, value: int | None, low: int) -> None:
    if value is not None and value < low:
        raise UsageError(f"{name} must be at least {low}, not {value}")


@contextmanager
def _snapshot() -> Iterator[tuple[Any, bool]]:
    """(connection or None, whether a database exists), inside one read transaction."""
    store = Store.open_existing(exokv_home())
    if store is None:
        yield None, False
        return
    with store, store.snapshot() as db:
        yield db, True


def _emit_json(doc: dict[str, Any]) -> None:
    # Plain print, not rich: JSON must not be wrapped or highlighted.
    print(json.dumps(doc, indent=2))


def _console() -> Console:
    # Piped output has no terminal width; rich's default of 80 would wrap every table.
    wide = not sys.stdout.isatty() and "COLUMNS" not in os.environ
    return Console(highlight=False, width=160 if wide else None)


def _plural(n: int, word: str) -> str:
    if n == 1:
        return f"{n} {word}"
    return f"{n} {word[:-1]}ies" if word.endswith("y") else f"{n} {word}s"


def _when(stamp: str | None) -> str:
    return tables.when(stamp)


def _sparkline(values: list[float]) -> str:
    top = len(_SPARKS) - 1
    return "".join(_SPARKS[max(0, min(top, int(v * len(_SPARKS))))] for v in values)


def _bar(level: float, width: int = 10) -> Text:
    """A pressure gauge in plain characters: it keeps its width in any table."""
    filled = round(width * min(max(level, 0.0), 1.0))
    bar = Text("━" * filled, style=_level(level))
    bar.append("━" * (width - filled), style="grey35")
    return bar


def _level(pressure: float) -> str:
    return "red" if pressure >= 0.9 else "yellow" if pressure >= 0.7 else "green"


def _run_lines(runs: list[dict[str, Any]]) -> list[str]:
    lines = []
    for run in runs:
        if run["running"]:
            state = f"running (pid {run['pid']})"
        elif run["ended"]:
            state = f"ended {_when(run['ended'])}"
        else:
            state = "stopped without ending (pid gone)"
        lines.append(
            f"[bold]run {run['id']}[/] · {run['model']} · {_plural(run['ranks'], 'rank')} · "
            f"started {_when(run['started'])} · {state}"
        )
    return lines


def _rank_label(row: dict[str, Any], many_runs: bool) -> str:
    return f"{row['run']}/{row['rank']}" if many_runs else str(row["rank"])


def _say_empty(has_db: bool, runs: list[dict[str, Any]]) -> bool:
    """Print the friendly line for an empty state; True when there was nothing to show."""
    if not has_db:
        _console().print(NO_SESSIONS)
        return True
    if not runs:
        _console().print(NO_CACHE)
        return True
    return False


@cache_app.command()
def stats(as_json: bool = typer.Option(False, "--json", help=JSON_HELP)) -> None:
    """Per rank and total: entries, cached tokens, bytes, budget, hits, misses, evictions."""
    with _snapshot() as (db, has_db):
        doc = queries.stats(db)
    if as_json:
        _emit_json(doc)
        return
    if _say_empty(has_db, doc["runs"]):
        return
    many = len(doc["runs"]) > 1
    console = _console()
    labels = [_rank_label(row, many) for row in doc["ranks"]]
    table = tables.stats_table(doc["ranks"], console.width, doc["total"], labels)
    for line in _run_lines(doc["runs"]):
        console.print(line)
    console.print(table)
    typed = tables.typeahead_line(doc["total"])
    if typed:
        console.print(typed)
    drafted = tables.speculation_line(doc["total"])
    if drafted:
        console.print(drafted)
    copied = _replica_line(doc["total"])
    if copied:
        console.print(copied)
    console.print(
        f"{_plural(doc['total']['turns'], 'turn')}, {_plural(doc['sessions'], 'session')}. "
        "Saved: prompt tokens not prefilled thanks to hits. Ranks take the same cache "
        "decisions, so their hits and evictions match.",
        style="dim",
    )


def _replica_line(total: dict[str, Any]) -> str | None:
    """What the replica copies (--replicas) did, or None when nothing was copied."""
    copied = int(total.get("replica_bytes") or 0)
    if not copied:
        return None
    turns = int(total.get("replica_turns") or 0)
    line = f"Replicas: {format_size(copied)} copied in {total.get('replica_s') or 0:.1f} s"
    median = total.get("replica_median_s")
    if median is not None:
        line += f" over {_plural(turns, 'turn')}; median {median:.2f} s a turn"
    return line + "."


@cache_app.command()
def entries(
    session: str | None = typer.Option(
        None, "--session", "-s", help="Only this session's entries."
    ),
    as_json: bool = typer.Option(False, "--json", help=JSON_HELP),
) -> None:
    """One row per live cache entry: id, session, tokens, bytes, hits, created, last used."""
    with _snapshot() as (db, has_db):
        runs = queries.current_runs(db)
        rows = queries.entries(db, session)
    if as_json:
        _emit_json({"runs": runs, "entries": rows})
        return
    if _say_empty(has_db, runs):
        return
    if not rows:
        suffix = f" for session {session!r}" if session is not None else ""
        _console().print(f"No live cache entries{suffix}.")
        return
    many = len(runs) > 1
    width = max(len(r["bytes"]) for r in rows)
    columns = [
        *([Column("Run", priority=2)] if many else []),
        Column("Id"),
        Column("Parent", priority=2),
        Column("Session", "left"),
        Column("Tokens"),
        Column("Depth", priority=2),
        Column("Tier", "left", priority=1),
        Column("Pinned", "left", priority=2),
        *[Column(f"Bytes r{k}", priority=0 if k == 0 else 3) for k in range(width)],
        Column("Hits", priority=1),
        Column("Created", "left", priority=1),
        Column("Last used", "left", priority=1),
    ]
    cells = []
    for r in rows:
        sizes = [format_size(r["bytes"][k]) if k < len(r["bytes"]) else "-" for k in range(width)]
        parent = "-" if r["parent"] is None else str(r["parent"])
        row = [str(r["id"]), parent, r["session"], tables.num(r["tokens"]), tables.num(r["depth"])]
        pinned = "yes" if r.get("pinned") else ""
        row += [
            r.get("tier", "ram"),
            pinned,
            *sizes,
            tables.num(r["hits"]),
            tables.when(r["created"]),
            tables.when(r["last_used"]),
        ]
        cells.append([*([str(r["run"])] if many else []), *row])
    console = _console()
    table = tables.fit(columns, cells, console.width)
    for line in _run_lines(runs):
        console.print(line)
    console.print(table)
    console.print(ENTRY_HITS, style="dim")


@cache_app.command()
def pressure(
    rank: int | None = typer.Option(None, "--rank", "-r", help="Only this rank."),
    history: int = typer.Option(30, "--history", help="How many recent samples to show."),
    as_json: bool = typer.Option(False, "--json", help=JSON_HELP),
) -> None:
    """Memory pressure per rank: the latest sample and a sparkline of recent ones."""
    _at_least("--rank", rank, 0)
    _at_least("--history", history, 1)
    with _snapshot() as (db, has_db):
        runs = queries.current_runs(db)
        rows = queries.pressure(db, rank, history)
    if rank is not None and runs and rank >= (count := max(run["ranks"] for run in runs)):
        raise UsageError(f"--rank {rank}: the current run has {_plural(count, 'rank')} (from 0)")
    if as_json:
        _emit_json({"runs": runs, "ranks": rows})
        return
    if _say_empty(has_db, runs):
        return
    many = len(runs) > 1
    # The disk tier's bytes, the replica copies of other ranks' files apart: shown only
    # when there are any, and the first columns a narrow terminal drops.
    disk = any(r.get("disk_bytes") for r in rows)
    replicas = any(r.get("replica_bytes") for r in rows)
    columns = [
        Column("Run/rank" if many else "Rank", "left"),
        Column("Pressure"),
        Column("", "left", priority=4),
        Column("Cache"),
        Column("Budget", priority=1),
        Column("Used"),
        Column("RSS", priority=2),
        Column("MLX", priority=3),
        Column("RAM", priority=2),
        *([Column("Disk", priority=5)] if disk else []),
        *([Column("Replicas", priority=5)] if replicas else []),
        Column(f"Last {history}", "left", priority=3),
        Column("At", "left", priority=1),
    ]
    cells = []
    for r in rows:
        level = r["pressure"] if r["pressure"] is not None else 0.0
        spark = _sparkline([h["pressure"] for h in r["history"]])
        held, copies = r.get("disk_bytes"), r.get("replica_bytes")
        own = None if held is None else held - (copies or 0)
        cells.append(
            [
                _rank_label(r, many),
                tables.pct(r["pressure"], 100),
                _bar(level),
                format_size(r["cache_bytes"]),
                format_size(r["budget"]),
                tables.share(r["cache_bytes"], r["budget"]),
                format_size(r["rss"]),
                format_size(r["mlx_active"]),
                format_size(r["ram_total"]),
                *([format_size(own)] if disk else []),
                *([format_size(copies)] if replicas else []),
                Text(spark, style=_level(level)),
                tables.when(r["time"]),
            ]
        )
    console = _console()
    for line in _run_lines(runs):
        console.print(line)
    if not rows:
        console.print("No memory samples in the current run yet.")
        return
    console.print(tables.fit(columns, cells, console.width))


@cache_app.command()
def evictions(
    rank: int | None = typer.Option(None, "--rank", "-r", help="Show bytes freed on this rank."),
    limit: int = typer.Option(20, "--limit", "-l", help="At most this many, newest first."),
    since: str | None = typer.Option(None, "--since", help="Only this recent: 90s, 30m, 1h, 2d."),
    as_json: bool = typer.Option(False, "--json", help=JSON_HELP),
) -> None:
    """The eviction log, newest first: what went, why, and every rank's pressure then."""
    _at_least("--rank", rank, 0)
    _at_least("--limit", limit, 1)
    start = parse_since(since) if since is not None else None
    with _snapshot() as (db, has_db):
        rows = queries.evictions(db, rank, limit, start)
    if as_json:
        _emit_json({"evictions": rows})
        return
    if not has_db:
        _console().print(NO_SESSIONS)
        return
    if not rows:
        _console().print("No evictions" + (f" since {since}." if since else " yet."))
        return
    console = _console()
    console.print(tables.evictions_table(rows, console.width, rank))


def _stdin_is_interactive() -> bool:
    return sys.stdin is not None and sys.stdin.isatty()


@cache_app.command()
def clear(
    yes: bool = typer.Option(False, "--yes", "-y", help="Do not ask for confirmation."),
    as_json: bool = typer.Option(False, "--json", help=JSON_HELP),
) -> None:
    """Forget cache entries, events, memory samples and the disk tier; keep conversations.

    Refuses while a chat is running: quit it first (its cache lives in its memory).
    """
    home = exokv_home()
    chats = running_chats(home)
    if chats:
        pids = ", ".join(str(p) for p in chats)
        raise ExokvError(
            f"a chat is running (pid {pids}): quit it first with /quit, "
            "then run `exokv cache clear` again"
        )
    store = Store.open_existing(home)  # first, so a damaged database is reported before asking
    if store is None and not caches_dir(home).exists():
        if as_json:
            _emit_json({"cleared": _cleared({})})
        else:
            _console().print("Nothing to clear.")
        return
    try:
        if not yes:
            _confirm_or_refuse()
        if store is None:
            counts = _cleared({"saved_caches": clear_saved_caches(home)})
        else:
            counts = _cleared(store.clear())
    finally:
        if store is not None:
            store.close()
    if as_json:
        _emit_json({"cleared": counts})
        return
    _console().print(
        f"Cleared the records of {_plural(counts['entries'], 'cache entry')}, "
        f"{_plural(counts['events'], 'event')}, {_plural(counts['samples'], 'memory sample')} "
        f"and {_plural(counts['saved_caches'], 'disk tier file')}. "
        "Sessions and messages are kept."
    )


def _cleared(counts: dict[str, int]) -> dict[str, int]:
    keys = ("entries", "events", "samples", "runs", "saved_caches")
    return {k: counts.get(k, 0) for k in keys}


def _confirm_or_refuse() -> None:
    if not _stdin_is_interactive():
        raise ExokvError("not clearing without confirmation: run `exokv cache clear --yes`")
    question = (
        "Delete the cache statistics, eviction log, memory samples and the KV cache on disk? "
        "(sessions and messages are kept)"
    )
    try:
        agreed = typer.confirm(question, default=False)
    except typer.Abort:  # Ctrl-C or end of input at the prompt
        agreed = False
    if not agreed:
        raise ExokvError("nothing cleared")
