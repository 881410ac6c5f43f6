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
from datetime import datetime
from typing import Any

import typer
from rich import box
from rich.console import Console
from rich.progress_bar import ProgressBar
from rich.table import Table

from exokv.config import exokv_home, format_size
from exokv.errors import ExokvError, UsageError
from exokv.state import Store, caches_dir, clear_saved_caches, queries, running_chats

cache_app = typer.Typer(
    help="Inspect the prefix cache: stats, entries, pressure, evictions.",
    no_args_is_help=True,
)

JSON_HELP = "Print one JSON document instead of a table."
NO_SESSIONS = "No sessions yet: start one with `exokv chat`."
NO_CACHE = "No cache activity recorded yet: it appears after the next `exokv chat` turn."
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


def _table(*columns: str) -> Table:
    """A compact table; a column named with a leading '<' is left-aligned (text), else numbers."""
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    for name in columns:
        left = name.startswith("<")
        table.add_column(name.lstrip("<"), justify="left" if left else "right", no_wrap=True)
    return table


def _plural(n: int, word: str) -> str:
    if n == 1:
        return f"{n} {word}"
    return f"{n} {word[:-1]}ies" if word.endswith("y") else f"{n} {word}s"


def _when(stamp: str | None) -> str:
    if stamp is None:
        return "-"
    local = datetime.fromisoformat(stamp).astimezone()
    if local.date() == datetime.now().astimezone().date():
        return local.strftime("%H:%M:%S")
    return local.strftime("%Y-%m-%d %H:%M")


def _size(n: int | None) -> str:
    return "-" if n is None else format_size(n)


def _pct(value: float | None, scale: float = 1.0) -> str:
    return "-" if value is None else f"{value * scale:.0f}%"


def _share(part: int | None, whole: int | None) -> str:
    return "-" if part is None or not whole else f"{100 * part / whole:.0f}%"


def _sparkline(values: list[float]) -> str:
    top = len(_SPARKS) - 1
    return "".join(_SPARKS[max(0, min(top, int(v * len(_SPARKS))))] for v in values)


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
    table = _table(
        "<Run/rank" if many else "<Rank",
        "Entries",
        "Tokens",
        "Bytes",
        "Budget",
        "Used",
        "Disk",
        "Hits",
        "Misses",
        "Hit rate",
        "Saved",
        "Evicted",
    )

    def cells(row: dict[str, Any], label: str) -> list[str]:
        return [
            label,
            str(row["entries"]),
            str(row["cached_tokens"]),
            _size(row["bytes"]),
            _size(row["budget"]),
            _pct(row["budget_pct"]),
            _size(row.get("disk_bytes") or 0),
            str(row["hits"]),
            str(row["misses"]),
            _pct(row["hit_rate"], 100),
            str(row["tokens_saved"]),
            str(row["evictions"]),
        ]

    for i, row in enumerate(doc["ranks"]):
        last = i == len(doc["ranks"]) - 1
        table.add_row(*cells(row, _rank_label(row, many)), end_section=last)
    table.add_row(*cells(doc["total"], "[bold]total[/]"))
    console = _console()
    for line in _run_lines(doc["runs"]):
        console.print(line)
    console.print(table)
    console.print(
        f"{_plural(doc['total']['turns'], 'turn')}, {_plural(doc['sessions'], 'session')}. "
        "Saved: prompt tokens not prefilled thanks to hits. Ranks take the same cache "
        "decisions, so their hits and evictions match."
    )


@cache_app.command()
def entries(
    session: str | None = typer.Option(
        None, "--session", "-s", help="Only this session's entries."
    ),
    as_json: bool = typer.Option(False, "--json", help=JSON_HELP),
) -> None:
    """One row per live cache entry: id, session, tokens, bytes on each rank, hits, last used."""
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
    table = _table(
        *(["Run"] if many else []),
        "Id",
        "Parent",
        "<Session",
        "Tokens",
        "Depth",
        "Tier",
        *[f"Bytes r{rank}" for rank in range(width)],
        "Hits",
        "<Last used",
    )
    for r in rows:
        sizes = [_size(r["bytes"][k]) if k < len(r["bytes"]) else "-" for k in range(width)]
        parent = "-" if r["parent"] is None else str(r["parent"])
        cells = [str(r["id"]), parent, r["session"], str(r["tokens"]), str(r["depth"])]
        cells += [r.get("tier", "ram"), *sizes]
        cells += [str(r["hits"]), _when(r["last_used"])]
        table.add_row(*([str(r["run"])] if many else []), *cells)
    console = _console()
    for line in _run_lines(runs):
        console.print(line)
    console.print(table)


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
    if as_json:
        _emit_json({"runs": runs, "ranks": rows})
        return
    if _say_empty(has_db, runs):
        return
    many = len(runs) > 1
    table = _table(
        "<Run/rank" if many else "<Rank",
        "Pressure",
        "<",
        "Cache",
        "Budget",
        "Used",
        "RSS",
        "MLX active",
        "RAM",
        f"<Last {history} samples",
        "<At",
    )
    for r in rows:
        level = r["pressure"] if r["pressure"] is not None else 0.0
        bar = ProgressBar(total=1.0, completed=min(level, 1.0), width=16)
        bar.complete_style = _level(level)
        spark = _sparkline([h["pressure"] for h in r["history"]])
        table.add_row(
            _rank_label(r, many),
            _pct(r["pressure"], 100),
            bar,
            _size(r["cache_bytes"]),
            _size(r["budget"]),
            _share(r["cache_bytes"], r["budget"]),
            _size(r["rss"]),
            _size(r["mlx_active"]),
            _size(r["ram_total"]),
            f"[{_level(level)}]{spark}[/]",
            _when(r["time"]),
        )
    console = _console()
    for line in _run_lines(runs):
        console.print(line)
    if not rows:
        console.print(f"No rank {rank} in the current run.")
        return
    console.print(table)


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
    ranks = [rank] if rank is not None else list(range(max(len(r["bytes"]) for r in rows)))
    table = _table(
        "<When",
        "Decision",
        "Entry",
        "<Session",
        "Tokens",
        *[f"Freed r{k}" for k in ranks],
        "<Reason",
        "<Pressure at decision",
    )
    for r in rows:
        freed = [_size(r["bytes"][k]) if k < len(r["bytes"]) else "-" for k in ranks]
        pressures = " ".join(f"r{k} {_pct(p, 100)}" for k, p in enumerate(r["pressures"]))
        table.add_row(
            _when(r["time"]),
            str(r["decision"]),
            str(r["entry"]),
            r["session"],
            str(r["tokens"]),
            *freed,
            r["reason"] or "-",
            pressures or "-",
        )
    _console().print(table)


def _stdin_is_interactive() -> bool:
    return sys.stdin is not None and sys.stdin.isatty()


@cache_app.command()
def clear(
    yes: bool = typer.Option(False, "--yes", "-y", help="Do not ask for confirmation."),
    as_json: bool = typer.Option(False, "--json", help=JSON_HELP),
) -> None:
    """Forget cache entries, events, memory samples and saved KV caches; keep conversations.

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
        f"and {_plural(counts['saved_caches'], 'saved cache file')}. "
        "Sessions and messages are kept."
    )


def _cleared(counts: dict[str, int]) -> dict[str, int]:
    keys = ("entries", "events", "samples", "runs", "saved_caches")
    return {k: counts.get(k, 0) for k in keys}


def _confirm_or_refuse() -> None:
    if not _stdin_is_interactive():
        raise ExokvError("not clearing without confirmation: run `exokv cache clear --yes`")
    question = (
        "Delete the cache statistics, eviction log, memory samples and saved KV caches? "
        "(sessions and messages are kept)"
    )
    try:
        agreed = typer.confirm(question, default=False)
    except typer.Abort:  # Ctrl-C or end of input at the prompt
        agreed = False
    if not agreed:
        raise ExokvError("nothing cleared")
