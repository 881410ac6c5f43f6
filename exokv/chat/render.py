"""What the interactive chat prints, with rich: the banner, streamed replies, the prefill
progress bar, the status line after each reply, and the tables of the slash commands.

Colour follows rich's rules: none when `NO_COLOR` is set or output is not a terminal,
and no progress bar either when output is not a terminal (it would be noise in a log).
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from rich.console import Console
from rich.progress import Progress, ProgressColumn, Task, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from exokv.chat.conversation import COMMANDS, Outcome
from exokv.config import format_size
from exokv.records import TurnResult

# A prefill shorter than this, known at its start, gets no bar: it is over before it shows.
BAR_MIN_TOKENS = 1024
# ...unless it is still running after this long (a slow model or a cluster).
BAR_AFTER_S = 0.5
BAR_WIDTH = 36

# C0/C1 control characters but tab and newline: a reply must not drive the terminal.
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def visible(text: str) -> str:
    """Reply text as the terminal shows it: control characters become U+FFFD."""
    return _CONTROL.sub("\ufffd", text)


@dataclass
class BannerInfo:
    model: str
    ranks: int = 1
    parallel: str | None = None  # None for one rank
    split: str | None = None
    budgets: Sequence[int | None] = field(default_factory=list)
    session: str = ""
    no_cache: bool = False


class CachedBar(ProgressColumn):
    """A bar whose cached part (done before this turn) is drawn apart from the prefilled part."""

    def render(self, task: Task) -> Text:
        total = max(task.total or 1, 1)
        cached = int(BAR_WIDTH * task.fields.get("cached", 0) / total)
        done = max(int(BAR_WIDTH * task.completed / total), cached)
        bar = Text("━" * cached, style="cyan")
        bar.append("━" * (done - cached), style="green")
        bar.append("━" * (BAR_WIDTH - done), style="grey35")
        return bar


class Renderer:
    def __init__(self, console: Console | None = None, err: Console | None = None) -> None:
        self.console = console or Console(highlight=False)
        self.err = err or Console(stderr=True, highlight=False)
        self._progress: Progress | None = None
        self._task: Any = None
        self._cached: int | None = None
        self._turn_start = 0.0
        self._streamed = False
        self._last = "\n"

    # -- start -------------------------------------------------------------------------

    def banner(self, info: BannerInfo) -> None:
        c = self.console
        if info.ranks == 1:
            layout = "1 rank"
        else:
            layout = f"{info.ranks} ranks, {info.parallel or 'pipeline'} parallel"
            if info.split:
                layout += f" (layers {info.split})"
        if info.no_cache:
            budget = "prefix cache off (--no-cache)"
        elif 0 in info.budgets:
            budget = "no prefix cache kept (--cache-budget 0)"
        elif len(info.budgets) <= 1:
            b = info.budgets[0] if info.budgets else None
            budget = f"cache budget {_size(b)}"
        else:
            budget = "cache budgets " + ", ".join(
                f"r{r} {_size(b)}" for r, b in enumerate(info.budgets)
            )
        head = Text("exokv", style="bold")
        head.append(f" · {info.model} · {layout} · {budget}")
        c.print(head, soft_wrap=True)
        keys = (
            "Enter sends · Esc+Enter or a trailing \\ starts a new line · Tab completes · "
            "Ctrl-C stops a reply · Ctrl-D quits · /help"
        )
        c.print(Text(keys, style="dim"), soft_wrap=True)

    # -- one turn ----------------------------------------------------------------------

    def begin_turn(self) -> None:
        self._turn_start = time.perf_counter()
        self._streamed = False
        self._cached = None
        self._last = "\n"

    def on_progress(self, done: int, total: int) -> None:
        """mlx-lm's prompt progress: `done` of `total` prompt tokens are in the cache."""
        if self._streamed or not self.console.is_terminal:
            return
        if self._progress is None:
            if self._cached is None:
                self._cached = done  # the first call: what the cache held before prefill
            remaining = total - done
            slow = time.perf_counter() - self._turn_start >= BAR_AFTER_S
            if remaining < BAR_MIN_TOKENS and not slow:
                return
            self._progress = Progress(
                TextColumn("[dim]prefill"),
                CachedBar(),
                TextColumn("{task.completed:,}/{task.total:,} tokens"),
                TextColumn("[dim]({task.fields[cached]:,} cached)"),
                TimeElapsedColumn(),
                console=self.console,
                transient=True,
            )
            self._progress.start()
            self._task = self._progress.add_task("prefill", total=total, cached=self._cached)
        self._progress.update(self._task, completed=done, total=total)

    def _stop_progress(self) -> None:
        if self._progress is not None:
            self._progress.stop()
        self._progress = None
        self._task = None

    def on_text(self, text: str) -> None:
        if not text:
            return
        if not self._streamed:
            self._stop_progress()
            self._streamed = True
        text = visible(text)
        # Straight to the file: rich would expand tabs and wrap, and a reply is plain text.
        self.console.file.write(text)
        self.console.file.flush()
        self._last = text[-1]

    def end_turn(self) -> None:
        self._stop_progress()
        self._cached = None
        if self._streamed and self._last != "\n":
            self.console.file.write("\n")
            self.console.file.flush()
        self._streamed = False
        self._last = "\n"

    def status(self, result: TurnResult) -> None:
        self.console.print(Text(status_line(result), style="dim"), soft_wrap=True)

    # -- messages and tables -------------------------------------------------------------

    def note(self, text: str) -> None:
        self.console.print(Text(text, style="dim"), soft_wrap=True)

    def message(self, text: str, error: bool = False) -> None:
        if error:
            self.err.print(Text(text, style="red"), soft_wrap=True)
        else:
            self.console.print(Text(text), soft_wrap=True)

    def warning(self, text: str) -> None:
        self.err.print(Text(f"exokv: warning: {text}", style="yellow"), soft_wrap=True)

    def error(self, text: str) -> None:
        self.err.print(Text(f"exokv: error: {text}", style="red"), soft_wrap=True)

    def outcome(self, outcome: Outcome) -> None:
        """Everything a handled line shows after its streamed reply (if any)."""
        if outcome.result is not None:
            self.status(outcome.result)
        elif outcome.command == "/help":
            self.help()
        elif outcome.command == "/sessions" and outcome.data is not None:
            self.sessions(outcome.data)
        elif outcome.command == "/stats" and outcome.data is not None:
            self.stats(outcome.data)
        elif outcome.command == "/evictions" and outcome.data is not None:
            self.evictions(outcome.data)
        elif outcome.message:
            self.message(outcome.message, outcome.error)

    def help(self) -> None:
        table = Table(box=None, show_header=False, pad_edge=False)
        table.add_column(style="bold")
        table.add_column()
        for name, text in COMMANDS.items():
            table.add_row(name, text)
        table.add_row("", "")
        table.add_row("Enter", "send the line")
        table.add_row("Esc+Enter, \\", "new line (Esc then Enter, or end the line with \\)")
        table.add_row("Tab", "complete a command or a session name")
        table.add_row("Ctrl-C", "stop the reply (the part so far is kept: /retry or /undo)")
        table.add_row("Ctrl-D", "quit (the KV cache of this session is saved)")
        self.console.print(table)

    def sessions(self, rows: list[dict[str, Any]]) -> None:
        if not rows:
            self.note("no sessions yet")
            return
        table = Table(title=None, header_style="bold")
        for name, justify in (
            ("session", "left"),
            ("turns", "right"),
            ("tokens", "right"),
            ("cached tokens", "right"),
            ("last used", "left"),
        ):
            table.add_column(name, justify=justify)  # type: ignore[arg-type]
        for r in rows:
            name = ("* " if r.get("current") else "  ") + r["name"]
            table.add_row(
                name,
                str(r.get("turns", 0)),
                f"{r.get('tokens', 0) or 0:,}",
                f"{r.get('cached_tokens', 0) or 0:,}",
                _when(r.get("last_used")),
            )
        self.console.print(table)

    def stats(self, rows: list[dict[str, Any]]) -> None:
        if not rows:
            self.note("no cache statistics yet: send a message first")
            return
        table = Table(header_style="bold")
        for name in ("rank", "entries", "cached tokens", "bytes", "budget", "% budget"):
            table.add_column(name, justify="right")
        for name in ("hits", "misses", "hit rate", "evictions"):
            table.add_column(name, justify="right")
        for r in rows:
            budget = r.get("budget")
            pct = r.get("budget_pct")
            rate = r.get("hit_rate")
            table.add_row(
                str(r.get("rank", 0)),
                f"{r.get('entries', 0):,}",
                f"{r.get('cached_tokens', 0) or 0:,}",
                _size(r.get("bytes", r.get("cache_bytes"))),
                _size(budget),
                "-" if pct is None else f"{pct:.1f}%",
                _num(r.get("hits")),
                _num(r.get("misses")),
                "-" if rate is None else f"{100 * rate:.0f}%",
                _num(r.get("evictions")),
            )
        self.console.print(table)

    def evictions(self, rows: list[dict[str, Any]]) -> None:
        if not rows:
            self.note("no evictions yet")
            return
        table = Table(header_style="bold")
        for name, justify in (
            ("when", "left"),
            ("decision", "right"),
            ("entry", "right"),
            ("session", "left"),
            ("tokens", "right"),
            ("freed per rank", "right"),
            ("reason", "left"),
            ("pressure per rank", "right"),
        ):
            table.add_column(name, justify=justify)  # type: ignore[arg-type]
        for r in rows:
            table.add_row(
                _when(r.get("time")),
                str(r.get("decision", "")),
                str(r.get("entry", "")),
                r.get("session") or "",
                f"{r.get('tokens', 0):,}",
                ", ".join(_size(b) for b in r.get("bytes", [])),
                r.get("reason") or "",
                ", ".join(f"{100 * p:.0f}%" for p in r.get("pressures", [])),
            )
        self.console.print(table)


def status_line(r: TurnResult) -> str:
    """One line of numbers after a reply; `N cached (P%)` is what the tests read."""
    pct = 100 * r.cached_tokens / r.prompt_tokens if r.prompt_tokens else 0.0
    parts = [
        f"{r.prompt_tokens:,} prompt",
        f"{r.cached_tokens:,} cached ({pct:.0f}%)",
        f"{r.prefilled_tokens:,} prefilled",
        f"{r.generated_tokens:,} generated",
        f"TTFT {_seconds(r.ttft_s)}",
        f"{r.decode_tps:,.1f} tok/s",
    ]
    if r.evictions:
        parts.append(f"{r.evictions} eviction{'s' if r.evictions != 1 else ''}")
    if r.finish_reason == "interrupted":
        parts.append("interrupted (/retry regenerates, /undo drops it)")
    elif r.finish_reason == "length":
        parts.append("stopped at --max-tokens")
    return " · ".join(parts)


def _seconds(s: float) -> str:
    return f"{s * 1000:.0f} ms" if s < 1 else f"{s:.2f} s"


def _size(b: int | None) -> str:
    return "-" if b is None else format_size(b)


def _num(n: Any) -> str:
    return "-" if n is None else f"{n:,}"


def _when(iso: str | None) -> str:
    if not iso:
        return "-"
    try:
        t = datetime.fromisoformat(iso).astimezone()
    except ValueError:
        return iso
    return t.strftime("%Y-%m-%d %H:%M:%S")
