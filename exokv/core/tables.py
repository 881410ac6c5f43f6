"""Tables that fit the terminal: short headers, compact numbers, columns dropped by priority.

Every table of `exokv cache ...`, `exokv sessions list` and the chat's `/stats`,
`/evictions` and `/sessions` is built here, so they read alike. A table never cuts a
cell: when the columns do not fit the width, the least important ones are left out
(and named in a footnote); when even the essential ones do not fit, each row is
stacked as `header: value` lines. Names and numbers are what people type or compare,
so they are always whole.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from rich import box
from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from exokv.core.sizes import format_size

ESSENTIAL = 0  # a column of this priority is never dropped (rows stack instead)


@dataclass
class Column:
    header: str
    justify: str = "right"  # numbers right, text left
    priority: int = ESSENTIAL  # higher numbers are dropped first


Cell = str | Text


def _cell(value: Cell) -> Text:
    return value if isinstance(value, Text) else Text(str(value))


def _table(columns: Sequence[Column], rows: Sequence[Sequence[Cell]], keep: list[int]) -> Table:
    table = Table(
        box=box.SIMPLE_HEAD,
        show_edge=False,
        pad_edge=False,
        padding=(0, 1, 0, 0),
        header_style="bold",
    )
    for i in keep:
        c = columns[i]
        table.add_column(c.header, justify=c.justify, no_wrap=True)  # type: ignore[arg-type]
    last = len(rows) - 1
    for n, row in enumerate(rows):
        # A row of None marks where the summary (total) starts.
        if row is None:
            continue
        section = n < last and rows[n + 1] is None
        table.add_row(*(_cell(row[i]) for i in keep), end_section=section)
    return table


def _natural_width(table: Table) -> int:
    probe = Console(width=10_000, color_system=None, record=True, file=_Null())
    probe.print(table)
    return max((len(line) for line in probe.export_text().splitlines()), default=0)


class _Null:
    def write(self, _text: str) -> int:
        return 0

    def flush(self) -> None:
        pass


def fit(
    columns: Sequence[Column], rows: Sequence[Sequence[Cell] | None], width: int
) -> RenderableType:
    """The table of `rows` at most `width` wide, dropping or stacking as needed."""
    keep = list(range(len(columns)))
    dropped: list[str] = []
    while True:
        table = _table(columns, rows, keep)
        if _natural_width(table) <= width:
            break
        droppable = [i for i in keep if columns[i].priority > ESSENTIAL]
        if not droppable:
            return _stacked(columns, rows, width)
        # The least important column goes first; of equals, the rightmost.
        worst = max(droppable, key=lambda i: (columns[i].priority, i))
        keep.remove(worst)
        if columns[worst].header.strip():
            dropped.append(columns[worst].header.strip())
    if not dropped:
        return table
    note = Text(f"(not shown at this width: {', '.join(reversed(dropped))})", style="dim")
    return Group(table, note)


def _stacked(
    columns: Sequence[Column], rows: Sequence[Sequence[Cell] | None], width: int
) -> RenderableType:
    """One block per row, `header  value` per line (the value under its header when the
    two do not fit on one line): nothing cut however narrow."""
    label = max(len(c.header) for c in columns)
    parts: list[RenderableType] = []
    for row in rows:
        if row is None:
            continue
        for c, value in zip(columns, row, strict=False):
            if not c.header.strip():
                continue  # a drawing (the pressure bar) says nothing on its own line
            cell = _cell(value)
            line = Text(f"{c.header:>{label}}  ", style="bold", no_wrap=True, overflow="fold")
            if label + 2 + cell.cell_len > width:
                parts.append(Text(c.header, style="bold"))
                line = Text("", no_wrap=True, overflow="fold")
            line.append_text(cell)
            parts.append(line)
        parts.append(Text(""))
    return Group(*parts)


# -- cells --------------------------------------------------------------------------


def when(stamp: str | None, today: datetime | None = None) -> str:
    """An ISO time as `20:53:07` today, `11-29 20:53` on another day."""
    if not stamp:
        return "-"
    try:
        local = datetime.fromisoformat(stamp).astimezone()
    except ValueError:
        return stamp
    now = (today or datetime.now()).astimezone()
    if local.date() == now.date():
        return local.strftime("%H:%M:%S")
    if local.year == now.year:
        return local.strftime("%m-%d %H:%M")
    return local.strftime("%Y-%m-%d")


def num(n: Any) -> str:
    return "-" if n is None else f"{n:,}"


def pct(value: float | None, scale: float = 1.0) -> str:
    return "-" if value is None else f"{value * scale:.0f}%"


def share(part: int | None, whole: int | None) -> str:
    return "-" if part is None or not whole else f"{100 * part / whole:.0f}%"


# -- the shared tables -------------------------------------------------------------


STATS_COLUMNS = [
    Column("Rank", "left"),
    Column("Entries", priority=2),
    Column("Tokens"),
    Column("Bytes"),
    Column("Budget", priority=1),
    Column("Used"),
    Column("Disk", priority=3),
    Column("Hits"),
    Column("Misses", priority=2),
    Column("Hit%", priority=1),
    Column("Saved", priority=3),
    Column("Evicted", priority=1),
]


def stats_row(row: dict[str, Any], label: Cell) -> list[Cell]:
    return [
        label,
        num(row.get("entries")),
        num(row.get("cached_tokens")),
        format_size(row.get("bytes", row.get("cache_bytes"))),
        format_size(row.get("budget")),
        pct(row.get("budget_pct")),
        format_size(row.get("disk_bytes")),
        num(row.get("hits")),
        num(row.get("misses")),
        pct(row.get("hit_rate"), 100),
        num(row.get("tokens_saved")),
        num(row.get("evictions")),
    ]


def stats_table(
    rows: Sequence[dict[str, Any]],
    width: int,
    total: dict[str, Any] | None = None,
    labels: Sequence[str] | None = None,
) -> RenderableType:
    cells: list[Sequence[Cell] | None] = [
        stats_row(r, labels[i] if labels else str(r.get("rank", i))) for i, r in enumerate(rows)
    ]
    columns = list(STATS_COLUMNS)
    if labels and any("/" in label for label in labels):
        columns[0] = Column("Run/rank", "left")
    if total is not None:
        cells += [None, stats_row(total, Text("total", style="bold"))]
    return fit(columns, cells, width)


def evictions_table(
    rows: Sequence[dict[str, Any]], width: int, rank: int | None = None
) -> RenderableType:
    ranks = [rank] if rank is not None else list(range(max(len(r["bytes"]) for r in rows)))
    columns = [
        Column("When", "left", priority=1),
        Column("Decision", priority=2),
        Column("Entry", priority=1),
        Column("Session", "left"),
        Column("Tokens"),
        *[Column(f"Freed r{k}", priority=0 if k == ranks[0] else 3) for k in ranks],
        Column("Reason", "left", priority=1),
        Column("Pressure", "left", priority=2),
    ]
    cells: list[Sequence[Cell] | None] = []
    for r in rows:
        freed = [format_size(r["bytes"][k]) if k < len(r["bytes"]) else "-" for k in ranks]
        pressures = " ".join(f"r{k} {pct(p, 100)}" for k, p in enumerate(r.get("pressures", [])))
        cells.append(
            [
                when(r.get("time")),
                str(r.get("decision", "")),
                str(r.get("entry", "")),
                r.get("session") or "-",
                num(r.get("tokens")),
                *freed,
                r.get("reason") or "-",
                pressures or "-",
            ]
        )
    return fit(columns, cells, width)


def sessions_table(rows: Sequence[dict[str, Any]], width: int) -> RenderableType:
    """`/sessions` and `exokv sessions list`: `*` marks the chat's current session, `pinned`
    a session pinned with /pin."""
    columns = [
        Column("Session", "left"),
        Column("Turns"),
        Column("Tokens", priority=1),
        Column("Cached", priority=2),
        Column("Model", "left", priority=3),
        Column("Last used", "left", priority=1),
    ]
    cells: list[Sequence[Cell] | None] = []
    for r in rows:
        name = Text(("* " if r.get("current") else "  ") if "current" in r else "")
        name.append(r["name"], style="bold" if r.get("current") else "")
        if r.get("pinned"):
            name.append(" pinned", style="cyan")
        cells.append(
            [
                name,
                num(r.get("turns", 0)),
                num(r.get("tokens", 0) or 0),
                num(r.get("cached_tokens", 0) or 0),
                r.get("model") or "-",
                when(r.get("last_used")),
            ]
        )
    return fit(columns, cells, width)


def speculation_line(row: dict[str, Any]) -> str | None:
    """What speculative decoding did (a stats row or total), or None when nothing was drafted."""
    drafted = int(row.get("draft_tokens") or 0)
    if not drafted:
        return None
    accepted = int(row.get("accepted_tokens") or 0)
    # Short enough for a 60-column terminal: each kept token is a forward pass saved.
    return (
        f"Speculation: {accepted:,} of {drafted:,} drafted kept ({pct(accepted / drafted, 100)})."
    )


def typeahead_line(row: dict[str, Any]) -> str | None:
    """What typing ahead did (a stats row or total), or None when it never ran."""
    steps = int(row.get("typeahead_steps") or 0)
    if not steps:
        return None
    done, used = int(row.get("typeahead_tokens") or 0), int(row.get("typeahead_used") or 0)
    return (
        f"Typed ahead: {done:,} tokens prefilled before Enter in {steps:,} "
        f"step{'s' if steps != 1 else ''}; {used:,} of them used by turns."
    )
