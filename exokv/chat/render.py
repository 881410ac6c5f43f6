"""What the interactive chat prints, with rich: the banner, streamed replies, the prefill
progress bar, the status line after each reply, and the tables of the slash commands.

Colour follows rich's rules: none when `NO_COLOR` is set or output is not a terminal,
and no progress bar either when output is not a terminal (it would be noise in a log).
Replies are rendered as markdown while they stream (exokv.chat.markdown) on a terminal
with colour; with `--plain`, `NO_COLOR`, a dumb terminal or output that is not a
terminal they are printed as the raw text, as the model wrote it.
"""

from __future__ import annotations

import re
import textwrap
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from rich.console import Console
from rich.progress import (
    Progress,
    ProgressColumn,
    SpinnerColumn,
    Task,
    TextColumn,
)
from rich.table import Table
from rich.text import Text

from exokv.chat.conversation import COMMANDS, Outcome
from exokv.chat.eta import PrefillClock, clock_text
from exokv.chat.markdown import MarkdownStream
from exokv.config import TEST_HOOKS
from exokv.core import tables
from exokv.core.records import TurnResult
from exokv.core.sizes import format_size

# A prefill shorter than this, known at its start, gets no bar: it is over before it shows.
BAR_MIN_TOKENS = 1024
# ...unless it is still running this long after Enter (a slow model or a cluster): then
# the bar shows, from the last progress heard, whether or not another report came since.
BAR_AFTER_S = 0.5
BAR_WIDTH = 36
# From Enter on something moves: a spinner this soon, until the bar or the reply shows
# (not at once: a command's answer comes sooner, and a spinner would only flash).
SPINNER_AFTER_S = 0.2

KEYS = (
    ("Enter", "send the line"),
    ("Esc+Enter, \\", "new line (Esc then Enter, or end the line with \\)"),
    ("Tab", "complete a command, a session name after /switch"),
    ("Up / Down", "walk the history (kept across runs)"),
    ("→", "take the grey suggestion from history"),
    ("Ctrl-C", "stop the reply (the part so far is kept: /retry or /undo)"),
    ("Ctrl-D", "quit (the session and its KV cache are saved)"),
)

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
    disk_budget: int | None = None  # per rank, when there is a disk tier
    disk_off: str | None = None  # why the disk tier is off though it was asked for


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


class SinceEnter(ProgressColumn):
    """The time since Enter, as rich's TimeElapsedColumn shows it (h:mm:ss), for the
    spinner and the bar alike: a task's own clock starts when it is added, so the bar
    that takes the spinner's place would start again from 0:00:00."""

    def __init__(self, start: Callable[[], float]) -> None:
        super().__init__()
        self.start = start

    def render(self, task: Task) -> Text:
        elapsed = max(0.0, time.perf_counter() - self.start())
        return Text(str(timedelta(seconds=int(elapsed))), style="progress.elapsed")


class RateColumn(ProgressColumn):
    """The prefill's tokens per second, as rich measures it from the bar's updates."""

    def render(self, task: Task) -> Text:
        speed = task.finished_speed or task.speed
        return Text(f"{speed:,.0f} tok/s" if speed else "", style="dim")


class LeftColumn(ProgressColumn):
    """The prefill's time left, as exokv.chat.eta prices the rest of the prompt (the
    rate falls as the prompt grows: rich's average rate would promise too little)."""

    def render(self, task: Task) -> Text:
        left = task.fields.get("left")
        return Text(f"{clock_text(left)} left" if left is not None else "", style="dim")


class Renderer:
    def __init__(
        self, console: Console | None = None, err: Console | None = None, plain: bool = False
    ) -> None:
        self.console = console or Console(highlight=False)
        self.err = err or Console(stderr=True, highlight=False)
        self.plain = plain  # --plain: replies as raw text even on a terminal
        self._markdown: MarkdownStream | None = None
        self._shown = _ShownReply.from_hook()
        self._progress: Progress | None = None
        self._task: Any = None
        self._spinner: Progress | None = None
        self._spin_timer: threading.Timer | None = None
        self._bar_timer: threading.Timer | None = None
        self._heard: tuple[int, int] | None = None  # the last progress, (done, total)
        self._live = threading.RLock()  # the spinner and the bar start on timers' threads
        self._cached: int | None = None
        self._eta = PrefillClock()
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
            budget = f"cache budget {format_size(b)}"
        else:
            budget = "cache budgets " + ", ".join(
                f"r{r} {format_size(b)}" for r, b in enumerate(info.budgets)
            )
        if info.disk_off and not info.no_cache:
            budget += f" · disk tier off: {info.disk_off}"
        elif info.disk_budget and not info.no_cache:
            budget += f" · disk tier {format_size(info.disk_budget)}"
        head = Text("exokv", style="bold")
        head.append(self._fit(f" · {info.model} · {layout} · {budget}", len("exokv")))
        c.print(head, soft_wrap=True)
        keys = (
            "Enter sends · Esc+Enter or a trailing \\ starts a new line · Tab completes · "
            "Ctrl-C stops a reply · Ctrl-D quits · /help"
        )
        c.print(Text(self._fit(keys), style="dim"), soft_wrap=True)

    def _fit(self, line: str, indent: int = 0) -> str:
        """`line` broken at its separators to the terminal's width (none off a terminal)."""
        if not self.console.is_terminal:
            return line
        return fit_line(line, self.console.width, indent)

    # -- one turn ----------------------------------------------------------------------

    def renders_markdown(self) -> bool:
        """Markdown on a terminal with colour, unless --plain; raw text otherwise."""
        c = self.console
        return not self.plain and c.is_terminal and not c.is_dumb_terminal and not c.no_color

    def begin_turn(self) -> None:
        self._turn_start = time.perf_counter()
        self._eta = PrefillClock()
        self._streamed = False
        self._cached = None
        self._last = "\n"
        self._heard = None
        if self.console.is_terminal:
            with self._live:
                self._spin_timer = _timer(SPINNER_AFTER_S, self._start_spinner)
                self._bar_timer = _timer(BAR_AFTER_S, self._bar_from_heard)

    def _start_spinner(self) -> None:
        """Something moving while nothing else shows: the draft step in flight, the trip
        to the ranks, a prefill whose first step has not reported yet."""
        with self._live:
            if self._spin_timer is None or self._progress is not None or self._streamed:
                return
            self._spin_timer = None
            self._spinner = Progress(
                SpinnerColumn(style="dim"),
                TextColumn("[dim]prefill"),
                SinceEnter(lambda: self._turn_start),
                console=self.console,
                transient=True,
            )
            self._spinner.add_task("waiting", total=None)
            self._spinner.start()

    def _stop_spinner(self) -> None:
        with self._live:
            if self._spin_timer is not None:
                self._spin_timer.cancel()
                self._spin_timer = None
            if self._spinner is not None:
                self._spinner.stop()
                self._spinner = None

    def on_progress(self, done: int, total: int) -> None:
        """The prefill's progress: `done` of `total` prompt tokens are in the cache."""
        if self._streamed or not self.console.is_terminal:
            return
        with self._live:
            self._heard = (done, total)
            self._eta.report(time.perf_counter(), done)
            if self._progress is None:
                if self._cached is None:
                    self._cached = done  # the first call: what the cache held before prefill
                slow = time.perf_counter() - self._turn_start >= BAR_AFTER_S
                if total - done < BAR_MIN_TOKENS and not slow:
                    return  # short: the bar timer shows it if it is still running then
                self._start_bar(done, total)
            left = self._eta.left(total)
            self._progress.update(self._task, completed=done, total=total, left=left)

    def _bar_from_heard(self) -> None:
        """BAR_AFTER_S after Enter: the bar, from the last progress, if the prefill runs
        still (its next report may be a slow step away)."""
        with self._live:
            if self._bar_timer is None:
                return  # cancelled: the turn's reply or its end came first
            self._bar_timer = None
            if self._progress is None and self._heard is not None and not self._streamed:
                self._start_bar(*self._heard)

    def _start_bar(self, done: int, total: int) -> None:
        self._stop_spinner()  # the bar takes its place
        self._progress = Progress(
            TextColumn("[dim]prefill"),
            CachedBar(),
            TextColumn("{task.completed:,}/{task.total:,} tokens"),
            TextColumn("[dim]({task.fields[cached]:,} cached)"),
            RateColumn(),
            SinceEnter(lambda: self._turn_start),
            LeftColumn(),
            console=self.console,
            transient=True,
        )
        self._progress.start()
        cached = done if self._cached is None else self._cached
        self._task = self._progress.add_task(
            "prefill", total=total, completed=done, cached=cached, left=None
        )

    def _stop_progress(self) -> None:
        with self._live:
            if self._bar_timer is not None:
                self._bar_timer.cancel()
                self._bar_timer = None
            self._stop_spinner()
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
            if self.renders_markdown():
                self._markdown = MarkdownStream(self.console)
        if self._shown is not None:
            text = self._shown.next(len(text))
        self._show(text)

    def _show(self, text: str) -> None:
        text = visible(text)
        if not text:
            return
        self._last = text[-1]
        if self._markdown is not None:
            self._markdown.feed(text)
            return
        # Straight to the file: rich would expand tabs and wrap, and a reply is plain text.
        self.console.file.write(text)
        self.console.file.flush()

    def end_turn(self) -> None:
        self._stop_progress()
        self._cached = None
        if self._shown is not None:
            self._shown.reset()  # the next reply shows the text again
        if self._markdown is not None:
            self._markdown.close()  # it prints whole lines
            self._markdown = None
            self._last = "\n"
        if self._streamed and self._last != "\n":
            self.console.file.write("\n")
            self.console.file.flush()
        self._streamed = False
        self._last = "\n"

    def status(self, result: TurnResult) -> None:
        self.console.print(Text(self._fit(status_line(result)), style="dim"), soft_wrap=True)

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
            if outcome.message:
                self.note(outcome.message)
        elif outcome.command == "/help":
            self.help()
        elif outcome.command == "/sessions" and outcome.data is not None:
            self.sessions(outcome.data)
            if outcome.message:
                self.note(outcome.message)
        elif outcome.command == "/stats" and outcome.data is not None:
            self.stats(outcome.data)
        elif outcome.command == "/evictions" and outcome.data is not None:
            self.evictions(outcome.data)
        elif outcome.command == "/hosts" and outcome.data:
            self.hosts(outcome.data)
        elif outcome.message:
            self.message(outcome.message, outcome.error)

    def help(self) -> None:
        table = Table(box=None, show_header=False, pad_edge=False)
        table.add_column(style="bold", no_wrap=True)
        table.add_column()
        # Text, not markup: `[all]` and `[NAME]` are words here, not styles.
        for name, text in COMMANDS.items():
            usage, _, what = text.partition("  ")
            table.add_row(Text(usage if what else name), Text(what or text))
        table.add_row(Text("//text"), Text("send a message that starts with /"))
        table.add_row("", "")
        for key, what in KEYS:
            table.add_row(Text(key), Text(what))
        self.console.print(table)

    def _width(self) -> int:
        return self.console.width

    def sessions(self, rows: list[dict[str, Any]]) -> None:
        if not rows:
            self.note("no sessions yet")
            return
        self.console.print(tables.sessions_table(rows, self._width()))

    def stats(self, rows: list[dict[str, Any]]) -> None:
        if not rows:
            self.note("no cache statistics yet: send a message first")
            return
        self.console.print(tables.stats_table(rows, self._width()))
        typed = tables.typeahead_line(rows[0])
        if typed:
            self.note(typed)
        drafted = tables.speculation_line(rows[0])
        if drafted:
            self.note(drafted)

    def hosts(self, rows: list[dict[str, Any]]) -> None:
        table = Table(box=None, pad_edge=False)
        for name in ("host", "state", "ranks", "layers"):
            table.add_column(name, no_wrap=name != "layers")
        for row in rows:
            ranks = ", ".join(map(str, row["ranks"])) or "-"
            table.add_row(Text(row["host"]), row["state"], ranks, Text(row["layers"] or "-"))
        self.console.print(table)

    def evictions(self, rows: list[dict[str, Any]]) -> None:
        if not rows:
            self.note("no evictions yet")
            return
        self.console.print(tables.evictions_table(rows, self._width()))


class _ShownReply:
    """EXOKV_TEST_SHOWN_REPLY: a fixed text shown in place of each reply, at its pace."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0

    @classmethod
    def from_hook(cls) -> _ShownReply | None:
        text = TEST_HOOKS.shown_reply()
        return None if text is None else cls(text)

    def next(self, length: int) -> str:
        piece = self.text[self.pos : self.pos + max(length, 1)]
        self.pos += len(piece)
        return piece

    def reset(self) -> None:
        self.pos = 0


def status_line(r: TurnResult) -> str:
    """One line of numbers after a reply; `N cached (P%)` is what the tests read."""
    parts = [
        f"{r.prompt_tokens:,} prompt",
        f"{r.cached_tokens:,} cached ({cached_share(r.cached_tokens, r.prompt_tokens)}%)",
        f"{r.prefilled_tokens:,} prefilled",
        f"{r.generated_tokens:,} generated",
        f"TTFT {_seconds(r.ttft_s)}",
        f"{r.decode_tps:,.1f} tok/s",
    ]
    if r.typed_ahead_tokens:  # of the cached tokens, those prefilled before Enter
        share = cached_share(r.typed_ahead_tokens, r.prompt_tokens)
        parts.append(f"{r.typed_ahead_tokens:,} typed ahead ({share}% of the prompt)")
    if r.evictions:
        parts.append(f"{r.evictions} eviction{'s' if r.evictions != 1 else ''}")
    if r.finish_reason == "interrupted":
        parts.append("interrupted (/retry regenerates, /undo drops it)")
    elif r.finish_reason == "length":
        parts.append("stopped at --max-tokens")
    return " · ".join(parts)


SEPARATOR = " · "


def fit_line(line: str, width: int, indent: int = 0) -> str:
    """`line`'s parts (joined by ` · `) packed into lines of at most `width` columns, a
    line broken only after a separator; a part wider than the terminal is broken at its
    spaces. `indent`: columns already taken on the first line."""
    if width <= 0 or indent + len(line) <= width:
        return line
    lead = line.startswith(SEPARATOR)
    parts = line.removeprefix(SEPARATOR).split(SEPARATOR) if lead else line.split(SEPARATOR)
    lines: list[str] = []
    current = SEPARATOR.rstrip() if lead else ""
    used = indent
    for i, part in enumerate(parts):
        piece = part + (SEPARATOR.rstrip() if i < len(parts) - 1 else "")
        gap = " " if current else ""
        if current and used + len(current) + len(gap) + len(piece) > width:
            lines.append(current.rstrip())
            current, used, gap = "", 0, ""
        if len(piece) > width:
            words = textwrap.wrap(piece, width, break_long_words=False, break_on_hyphens=False)
            lines.extend(words[:-1])
            piece = words[-1] if words else ""
        current += gap + piece
    lines.append(current.rstrip())
    return "\n".join(lines)


def cached_share(cached: int, prompt: int) -> int:
    """The cached percentage, rounded down: 100 only when nothing was prefilled."""
    return 100 * cached // prompt if prompt else 0


def _seconds(s: float) -> str:
    return f"{s * 1000:.0f} ms" if s < 1 else f"{s:.2f} s"


def _timer(seconds: float, call: Callable[[], None]) -> threading.Timer:
    timer = threading.Timer(seconds, call)
    timer.daemon = True
    timer.start()
    return timer
