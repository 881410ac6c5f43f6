"""`exokv bench`: cold, carried, mlx-lm-lru and exokv on the same conversations."""

from __future__ import annotations

import shlex
import sys
from typing import Any

import typer

from exokv.bench import SCENARIOS
from exokv.bench.scenarios import min_turn_tokens
from exokv.cli import flags
from exokv.config import default_model
from exokv.core.options import KvQuant
from exokv.core.sizes import parse_size
from exokv.errors import ExokvError, UsageError

BENCH_DEFAULT_MODEL = "builtin:base"
# (--turns, --context, --reply-tokens) by default and with --quick (a minute or so on
# builtin:base instead of several): what is not given explicitly.
SIZES = (8, 2000, 32)
QUICK_SIZES = (3, 600, 8)


# Long for its 15 option declarations: the body is short (issue 42).
def bench(
    model: str = typer.Option(
        None,
        "--model",
        "-m",
        help="builtin:NAME, smollm2, a path, a .gguf, ollama:NAME or a HF repo id",
    ),
    ranks: int = typer.Option(
        1, "--ranks", "-n", help="ranks on this machine, started by mlx.launch"
    ),
    parallel: str = typer.Option(
        "pipeline", "--parallel", help="pipeline|tensor (how --ranks > 1 shard the model)"
    ),
    starting_port: int = typer.Option(
        None, "--starting-port", help="first port of the ranks' ring (default: free ports)"
    ),
    turns: int = typer.Option(None, "--turns", help="turns per conversation (8; 3 with --quick)"),
    context: int = typer.Option(
        None, "--context", help="prompt tokens of the last turn (2000; 600 with --quick)"
    ),
    reply_tokens: int = typer.Option(
        None, "--reply-tokens", help="most tokens per reply (32; 8 with --quick)"
    ),
    quick: bool = typer.Option(
        False,
        "--quick",
        help="a short run: the sizes above that are not given take their --quick value",
    ),
    scenario: str = typer.Option(
        "all", "--scenario", help="linear|switch|branch|shared-prefix|restart|all (or a comma list)"
    ),
    repeat: int = typer.Option(1, "--repeat", help="runs per scenario; medians are reported"),
    seed: int = typer.Option(0, "--seed", help="seed of the generated conversations"),
    json_out: bool = typer.Option(False, "--json", help="print one JSON document to stdout"),
    plot: str = typer.Option(None, "--plot", help="write a PNG of TTFT per turn (matplotlib)"),
    cache_budget: str = typer.Option(
        None,
        "--cache-budget",
        help="the same cache byte budget for mlx-lm-lru (as mlx_lm.server --prompt-cache-bytes) "
        "and exokv, e.g. 48MB; cold and carried are not affected",
    ),
    kv_bits: int = typer.Option(
        None, "--kv-bits", help="quantized KV (4 or 8) for exokv and exokv+disk; drift reported"
    ),
    kv_group_size: int = flags.KV_GROUP_SIZE,
) -> None:
    """Compare cold, carried, mlx-lm-lru and exokv on the same conversations."""
    turns, context, reply_tokens = _sizes(quick, turns, context, reply_tokens)
    names = _scenarios(scenario, SCENARIOS)
    _check_counts(turns, reply_tokens, repeat, ranks)
    budget = _cache_budget(cache_budget)
    _check_layout(KvQuant(kv_bits, kv_group_size), parallel)
    _check_context(names, turns, context, reply_tokens)
    if plot:
        # deferred: exokv.bench.report imports mlx-lm (2 s); `exokv --help` never needs it
        from exokv.bench.report import check_plot_available

        check_plot_available()
    model = model or default_model(BENCH_DEFAULT_MODEL)

    # deferred: the runner loads mlx-lm (2 s); `exokv --help` never needs it
    from exokv.bench import runner

    config = runner.BenchConfig(
        model=model,
        turns=turns,
        context=context,
        reply_tokens=reply_tokens,
        scenarios=names,
        repeat=repeat,
        seed=seed,
        ranks=ranks,
        parallel=parallel,
        cache_budget=budget,
        kv=KvQuant(kv_bits, kv_group_size),
    )
    _report(_run(config, starting_port), json_out, plot)


def _sizes(
    quick: bool, turns: int | None, context: int | None, reply_tokens: int | None
) -> tuple[int, int, int]:
    """--turns, --context and --reply-tokens: as given, else the defaults (--quick's)."""
    given = (turns, context, reply_tokens)
    defaults = QUICK_SIZES if quick else SIZES
    return tuple(d if g is None else g for g, d in zip(given, defaults, strict=True))  # type: ignore[return-value]


def _check_counts(turns: int, reply_tokens: int, repeat: int, ranks: int) -> None:
    if turns < 1:
        raise UsageError(f"--turns must be at least 1 (got {turns})")
    if reply_tokens < 1:
        raise UsageError(f"--reply-tokens must be at least 1 (got {reply_tokens})")
    if repeat < 1:
        raise UsageError(f"--repeat must be at least 1 (got {repeat})")
    if ranks < 1:
        raise UsageError(f"--ranks must be at least 1 (got {ranks})")


def _cache_budget(cache_budget: str | None) -> int | None:
    """--cache-budget in bytes (None: not given)."""
    if cache_budget is None:
        return None
    try:
        budget = parse_size(cache_budget)
    except UsageError as err:
        raise UsageError(f"--cache-budget: {err}") from None
    if budget <= 0:
        raise UsageError(f"--cache-budget must be more than 0 bytes (got {cache_budget!r})")
    return budget


def _check_layout(kv: KvQuant, parallel: str) -> None:
    # deferred: exokv.cache.tier_options imports mlx.core and exokv.model (~0.2 s); this is
    # imported by every command (cli/app.py mounts it)
    from exokv.cache.tier_options import check_kv_quantization

    check_kv_quantization(kv)
    if parallel not in ("pipeline", "tensor"):
        raise UsageError(f"--parallel must be pipeline or tensor (got {parallel!r})")


def _check_context(names: list[str], turns: int, context: int, reply_tokens: int) -> None:
    """--context holds --turns turns of a short message and a --reply-tokens reply."""
    # shared-prefix gives its conversations' turns the half of --context that its
    # shared system prompt leaves.
    share = 2 if "shared-prefix" in names else 1
    need = share * turns * min_turn_tokens(reply_tokens)
    if context < need:
        where = " (shared-prefix: in the half its system prompt leaves)" if share > 1 else ""
        raise UsageError(
            f"--context {context} is smaller than {turns} turn(s) of at least "
            f"{min_turn_tokens(reply_tokens)} tokens{where} (a short message and a "
            f"{reply_tokens}-token reply): use --context {need} or more, or fewer --turns or "
            "--reply-tokens"
        )


def _run(config: Any, starting_port: int | None) -> dict[str, Any]:
    """The benchmark's document, the command line first: on one rank here, or on
    --ranks ranks."""
    # deferred: the report and the runner load mlx-lm (2 s); `exokv --help` never needs it
    from exokv.bench import report, runner

    if config.ranks > 1:
        # Every rank runs the same runner loop on its shard; rank 0 sends the document.
        # deferred: exokv.bench.ranks imports mlx.core and the launcher, only for --ranks > 1
        from exokv.bench.ranks import run_on_ranks

        with report.RichProgress() as progress:
            doc = run_on_ranks(config, progress, starting_port=starting_port)
    else:
        loaded, tokenizer = load(config.model)
        with report.RichProgress() as progress:
            doc = runner.run(config, loaded, tokenizer, progress)
    argv = sys.argv[sys.argv.index("bench") :] if "bench" in sys.argv else []
    return {"command": " ".join(["exokv", *map(shlex.quote, argv)]), **doc}


def _report(doc: dict[str, Any], json_out: bool, plot: str | None) -> None:
    """The document as JSON or tables, the plot; an error when the strategies' replies
    differ."""
    # deferred: exokv.bench.report imports mlx-lm (2 s); `exokv --help` never needs it
    from exokv.bench import report

    if json_out:
        sys.stdout.write(report.to_json(doc) + "\n")
    else:
        report.print_tables(doc)
    if plot:
        report.write_plot(doc, plot)
        print(f"exokv: plot written to {plot}", file=sys.stderr)
    if not doc["replies_match"]:  # (--kv-bits: exokv's drift is reported, not a mismatch)
        first = doc["mismatches"][0]
        raise ExokvError(
            f"replies differ between strategies in {len(doc['mismatches'])} turn(s) "
            f"(first: {first['scenario']} turn {first['turn']}, {first['strategy']} vs cold); "
            "the figures above are not comparable"
        )


def _scenarios(text: str, known: tuple[str, ...]) -> list[str]:
    names: list[str] = []
    for part in (p.strip() for p in text.split(",")):
        if part == "all":
            names.extend(known)
        elif part in known:
            names.append(part)
        else:
            raise UsageError(
                f"unknown scenario {part!r}: use {', '.join(known)} or all (or a comma list)"
            )
    return list(dict.fromkeys(names))


def load(name: str) -> tuple[Any, Any]:
    """The model and tokenizer, through exokv's resolver (a one-line error if missing)."""
    try:
        # deferred: exokv.model (~0.1 s) only when a benchmark runs, not for `exokv --help`
        from exokv.model.resolve import load_model
    except ImportError:  # the resolver is not there yet: builtins and local/HF via mlx-lm
        load_model = _load_fallback
    return load_model(name)


def _load_fallback(name: str) -> tuple[Any, Any]:
    # deferred: mlx-lm (2 s) and exokv.model only when a benchmark runs
    from mlx_lm.utils import load as mlx_load

    if name.startswith("builtin:"):
        # deferred: exokv.model (~0.1 s) only when a benchmark runs
        from exokv.model.builtin import SPECS, ensure_builtin

        which = name.split(":", 1)[1]
        if which not in SPECS:
            raise UsageError(f"unknown builtin model {name!r}: use builtin:{'|'.join(SPECS)}")
        path = str(ensure_builtin(which))
    else:
        path = name
    try:
        model, tokenizer = mlx_load(path)[:2]
    except Exception as err:  # noqa: BLE001 - any loader failure is one line
        raise ExokvError(f"cannot load model {name!r}: {err}") from None
    return model, tokenizer
