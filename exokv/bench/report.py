"""The bench's output: a rich progress bar, rich tables, the JSON document, the plot."""

from __future__ import annotations

import json
from typing import Any

from rich import box
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from exokv.bench import STRATEGIES
from exokv.bench import runner as bench_runner
from exokv.errors import ExokvError

PLOT_HINT = "--plot needs matplotlib: pip install 'exokv[plot]' (or pip install matplotlib)"


class RichProgress(bench_runner.Progress):
    """A progress bar on stderr, shown only on a terminal (stdout may carry the JSON)."""

    def __init__(self, console: Console | None = None) -> None:
        self.console = console or Console(stderr=True)
        self.bar = Progress(
            TextColumn("[bold]bench[/]"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            TextColumn("{task.description}"),
            console=self.console,
            transient=True,
            disable=not self.console.is_terminal,
        )
        self.task: Any = None

    def __enter__(self) -> RichProgress:
        self.bar.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.bar.__exit__(*exc)

    def start(self, total: int, estimate: str = "") -> None:
        if estimate:  # before the first measurement, on a terminal or not (stdout: JSON)
            self.console.print(f"exokv: bench: {estimate}", highlight=False, soft_wrap=True)
        self.task = self.bar.add_task("starting", total=total)
        self._running = False

    def advance(self, description: str) -> None:
        # Called as a measurement starts: the bar counts the ones finished.
        if self._running:
            self.bar.advance(self.task)
        self._running = True
        self.bar.update(self.task, description=description)


def to_json(doc: dict[str, Any]) -> str:
    return json.dumps(doc, indent=2)


def _s(x: float) -> str:
    return f"{x:.3f}s" if x < 10 else f"{x:.1f}s"


def _bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def print_tables(doc: dict[str, Any], console: Console | None = None) -> None:
    if console is None:
        console = Console()
        if not console.is_terminal:  # a file or a pipe: room for the whole table
            console = Console(width=160)
    console.print(
        f"[bold]exokv bench[/] {doc['model']}: {doc['turns']} turns to {doc['context']} tokens, "
        f"{doc['reply_tokens']}-token replies, median of {doc['repeat']} run(s), seed {doc['seed']}"
    )
    budget = doc.get("cache_budget")
    if budget is not None:
        which = " and ".join(doc["cache_budget_strategies"])
        console.print(
            f"[bold]cache budget {_bytes(budget)}[/] for {which} "
            "(mlx-lm-lru as mlx_lm.server --prompt-cache-bytes: trim_to(n_bytes=budget - active) "
            "when a request is admitted; exokv as EngineOptions(budget=...)). "
            "cold and carried are not affected by it (cold keeps nothing between turns, carried "
            "keeps one conversation, as mlx_lm.chat does)."
        )
    for name, s in doc["scenarios"].items():
        console.print(_scenario_table(name, s))
        console.print(_sizes_line(doc, s))
        if budget is not None:
            _print_budget(console, name, s, budget)
    console.print(_targets_table(doc["targets"]))
    if not doc["replies_match"]:
        console.print(f"[red]replies differ in {len(doc['mismatches'])} turn(s)[/]")


# Lighter than rich's default box: the columns' room goes to their figures.
_TABLE: dict[str, Any] = {
    "box": box.SIMPLE_HEAD,
    "pad_edge": False,
    "show_edge": False,
    "padding": (0, 1, 0, 1),
    "caption_justify": "left",
}

# What `met`/`missed` tell someone running the bench, under the targets table.
MISSED_MEANS = (
    "missed: exokv did not reach the project's goal for that figure on this machine and "
    "these sizes; the replies and caches are still right (the exit code is 0). Timings "
    "depend on the load, and small --context or --turns make fixed costs dominate."
)


def _scenario_table(name: str, s: dict[str, Any]) -> Table:
    """Each strategy's totals on one scenario, and the limit's. Names are never cut:
    the headers of the figures wrap instead."""
    table = Table(
        title=f"{name} ({len(s['turns'])} turns, last prompt {s['last_prompt_tokens']} tokens)",
        **_TABLE,
    )
    names = [*STRATEGIES, "limit"]
    table.add_column("strategy", no_wrap=True, min_width=max(map(len, names)))
    for col in ("total TTFT", "cached", "peak cache", "decode tok/s", "evicted", "exokv speedup"):
        table.add_column(col, justify="right", no_wrap=False)
    for strat in STRATEGIES:
        e = s["strategies"][strat]
        speed = s["speedup"].get(strat)
        table.add_row(
            strat,
            _s(e["total_ttft_s"]),
            f"{e['cached_fraction']:.3f}",
            _bytes(e["peak_cache_bytes"][0]),
            f"{e['median_decode_tps']:.0f}",
            str(e.get("evicted", 0)),
            f"{speed:.2f}x" if speed is not None else "",
        )
    lim = s["limit"]
    table.add_row(
        "[dim]limit[/]",
        _s(lim["total_ttft_s"]),
        f"{lim['cached_fraction']:.3f}",
        _bytes(s["ideal_cache_bytes"][0]),
        "",
        "",
        "",
    )
    table.caption = (
        "limit: the best any prefix cache could do (every earlier sequence kept); "
        f"ideal cached fraction {lim['ideal_cached_fraction']:.3f}"
    )
    return table


def _targets_table(targets: list[dict[str, Any]]) -> Table:
    table = Table(title="targets", caption=MISSED_MEANS, **_TABLE)
    table.add_column("target", ratio=3)
    for col in ("value", "threshold"):
        table.add_column(col, justify="right", no_wrap=True)
    table.add_column("met", no_wrap=True)
    table.add_column("detail", ratio=4)
    for t in targets:
        table.add_row(
            t["target"],
            f"{t['value']:.3f}",
            f"{t['threshold']:g}",
            "[green]met[/]" if t["met"] else "[red]missed[/]",
            t["detail"],
        )
    return table


def _sizes_line(doc: dict[str, Any], s: dict[str, Any]) -> str:
    """Bytes per token of exokv's cache against the model's own dtype and fp16, and
    under a budget, the share of the working set the budget holds (rank 0)."""
    ours, full, fp16 = (
        s[k][0] for k in ("bytes_per_token", "bytes_per_token_unquantized", "bytes_per_token_fp16")
    )
    dtype = s["kv_dtype"]
    if doc.get("kv_bits"):
        kv = (
            f"KV {ours} B/token at {doc['kv_bits']} bits (group {doc['kv_group_size']}): "
            f"{ours / full:.2f}x {dtype} ({full} B), {ours / fp16:.2f}x fp16 ({fp16} B)"
        )
    else:
        kv = f"KV {ours} B/token in {dtype} (fp16 would be {fp16} B)"
    if "budget_fraction_of_working_set" in s:
        kv += (
            f"; budget {_bytes(s['budget_bytes'])} = "
            f"{s['budget_fraction_of_working_set'][0]:.2f} of the working set "
            f"({_bytes(s['working_set_bytes'][0])}: distinct tokens x bytes per token)"
        )
    return kv


def _print_budget(console: Console, name: str, s: dict[str, Any], budget: int) -> None:
    table = Table(title=f"{name}: within the cache budget of {_bytes(budget)}?", **_TABLE)
    table.add_column("strategy", no_wrap=True, min_width=max(map(len, STRATEGIES)))
    for col in ("peak of what its policy bounds", "within", "what is bounded"):
        table.add_column(col, justify="right" if col.startswith("peak") else "left")
    for strat, e in s["strategies"].items():
        if "budget_peak_bytes" not in e:
            continue
        over = e.get("over_budget_turns", [])
        unavoidable = e.get("unavoidably_over_budget_turns", [])
        within = "[green]yes[/]" if not over else f"[red]no[/] (turns {_turns(over)})"
        if unavoidable:
            within += f"; over where the policy cannot help (turns {_turns(unavoidable)})"
        table.add_row(strat, _bytes(e["budget_peak_bytes"][0]), within, e["budget_accounting"])
    console.print(table)


def _turns(turns: list[int], most: int = 8) -> str:
    shown = ", ".join(map(str, turns[:most]))
    return shown + (f" and {len(turns) - most} more" if len(turns) > most else "")


def check_plot_available() -> None:
    try:
        import matplotlib  # noqa: F401 - deferred: optional, and only for --plot
    except ImportError:
        raise ExokvError(PLOT_HINT) from None


def write_plot(doc: dict[str, Any], path: str) -> None:
    """A PNG of TTFT per turn per strategy (and the limit), one panel per scenario."""
    try:
        # deferred: matplotlib only for --plot, and an optional dependency (PLOT_HINT)
        import matplotlib

        matplotlib.use("Agg")  # before pyplot: no display
        import matplotlib.pyplot as plt  # deferred with matplotlib, after its backend is set
    except ImportError:
        raise ExokvError(PLOT_HINT) from None
    from matplotlib.ticker import MaxNLocator  # deferred with matplotlib (--plot only)

    names = list(doc["scenarios"])
    cols = min(2, len(names))
    rows = (len(names) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 4 * rows), squeeze=False)
    flat = [ax for row in axes for ax in row]
    for ax in flat[len(names) :]:
        ax.set_visible(False)
    for ax, name in zip(flat, names, strict=False):
        turns = doc["scenarios"][name]["turns"]
        x = [t["turn"] for t in turns]
        for strat in STRATEGIES:
            ax.plot(x, [t["strategies"][strat]["ttft_s"] for t in turns], marker="o", label=strat)
        ax.plot(x, [t["limit_ttft_s"] for t in turns], linestyle="--", color="gray", label="limit")
        ax.set_title(name)
        ax.set_xlabel("turn")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel("TTFT (s)")
        ax.grid(alpha=0.3)
    axes[0][0].legend()
    title = f"exokv bench: {doc['model']}, {doc['turns']} turns to {doc['context']} tokens"
    if doc.get("cache_budget") is not None:
        which = doc.get("cache_budget_strategies") or ["mlx-lm-lru", "exokv"]
        title += f"\ncache budget {_bytes(doc['cache_budget'])} ({', '.join(which)})"
    fig.suptitle(title)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    except OSError as err:
        raise ExokvError(f"cannot write the plot to {path}: {err.strerror or err}") from None
    finally:
        plt.close(fig)
