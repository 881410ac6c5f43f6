"""`exokv bench`: cold, carried, mlx-lm-lru and exokv on the same conversations."""

from __future__ import annotations

import shlex
import sys
from typing import Any

import typer

from exokv.cli import flags
from exokv.errors import ExokvError, UsageError

BENCH_DEFAULT_MODEL = "builtin:base"


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
    turns: int = typer.Option(8, "--turns", help="turns per conversation"),
    context: int = typer.Option(2000, "--context", help="prompt tokens of the last turn"),
    reply_tokens: int = typer.Option(32, "--reply-tokens", help="most tokens per reply"),
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
    from exokv.bench import SCENARIOS
    from exokv.bench.scenarios import min_turn_tokens

    names = _scenarios(scenario, SCENARIOS)
    if turns < 1:
        raise UsageError(f"--turns must be at least 1 (got {turns})")
    if reply_tokens < 1:
        raise UsageError(f"--reply-tokens must be at least 1 (got {reply_tokens})")
    if repeat < 1:
        raise UsageError(f"--repeat must be at least 1 (got {repeat})")
    if ranks < 1:
        raise UsageError(f"--ranks must be at least 1 (got {ranks})")
    budget = None
    if cache_budget is not None:
        from exokv.core.sizes import parse_size

        try:
            budget = parse_size(cache_budget)
        except UsageError as err:
            raise UsageError(f"--cache-budget: {err}") from None
        if budget <= 0:
            raise UsageError(f"--cache-budget must be more than 0 bytes (got {cache_budget!r})")
    from exokv.cache.tier_options import check_kv_quantization
    from exokv.core.options import KvQuant

    check_kv_quantization(KvQuant(kv_bits, kv_group_size))
    if parallel not in ("pipeline", "tensor"):
        raise UsageError(f"--parallel must be pipeline or tensor (got {parallel!r})")
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
    if plot:
        from exokv.bench.report import check_plot_available

        check_plot_available()
    from exokv.config import default_model

    model = model or default_model(BENCH_DEFAULT_MODEL)

    from exokv.bench import report, runner

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
        kv_bits=kv_bits,
        kv_group_size=kv_group_size,
    )
    if ranks > 1:
        # Every rank runs the same runner loop on its shard; rank 0 sends the document.
        from exokv.bench.ranks import run_on_ranks

        with report.RichProgress() as progress:
            doc = run_on_ranks(config, progress, starting_port=starting_port)
    else:
        loaded, tokenizer = load(model)
        with report.RichProgress() as progress:
            doc = runner.run(config, loaded, tokenizer, progress)
    argv = sys.argv[sys.argv.index("bench") :] if "bench" in sys.argv else []
    doc = {"command": " ".join(["exokv", *map(shlex.quote, argv)]), **doc}
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
        from exokv.model.resolve import load_model
    except ImportError:  # the resolver is not there yet: builtins and local/HF via mlx-lm
        load_model = _load_fallback
    return load_model(name)


def _load_fallback(name: str) -> tuple[Any, Any]:
    from mlx_lm.utils import load as mlx_load

    if name.startswith("builtin:"):
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
