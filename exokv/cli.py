"""The Typer app: parse, call, render, exit code. No computing here."""

from __future__ import annotations

import sys
import traceback

import click
import typer

from exokv.config import debug_enabled
from exokv.errors import ExokvError, UsageError

app = typer.Typer(
    name="exokv",
    help="Chat with a model split across several Macs, with a rank-coherent KV prefix cache.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.command()
def chat(
    model: str = typer.Option(
        None, "--model", "-m", help="builtin:tiny|small|base, a path or a HF repo id"
    ),
    system: str = typer.Option(None, "--system", help="system prompt"),
    max_tokens: int = typer.Option(256, "--max-tokens", help="most tokens per reply"),
    temp: float = typer.Option(0.0, "--temp", help="sampling temperature"),
    seed: int = typer.Option(None, "--seed", help="random seed"),
    ranks: int = typer.Option(1, "--ranks", "-n", help="ranks on this machine"),
    hosts: str = typer.Option(None, "--hosts", help="a,b,... one rank per host"),
    hostfile: str = typer.Option(None, "--hostfile", help="mlx hostfile (JSON)"),
    backend: str = typer.Option("ring", "--backend", help="ring|jaccl|mpi"),
    parallel: str = typer.Option("pipeline", "--parallel", help="pipeline|tensor"),
    split: str = typer.Option(None, "--split", help="layers per rank, e.g. 3,1"),
    cache_budget: str = typer.Option(
        None, "--cache-budget", help="bytes per rank: 2GB or 64MB,16MB"
    ),
    memory_threshold: float = typer.Option(
        0.9, "--memory-threshold", help="RAM fraction that triggers eviction"
    ),
    max_kv_size: int = typer.Option(
        None, "--max-kv-size", help="rotating KV cache of this many tokens"
    ),
    no_cache: bool = typer.Option(False, "--no-cache", help="prefill the whole prompt every turn"),
    session: str = typer.Option(
        None, "--session", help="name the conversation; resumes it if it exists"
    ),
    json_out: bool = typer.Option(False, "--json", help="script mode: one JSON object per turn"),
    starting_port: int = typer.Option(None, "--starting-port", help="first port for the ranks"),
) -> None:
    """Chat with the model: a REPL on a terminal, script mode otherwise."""
    from exokv.chat.run import ChatOptions, run_chat
    from exokv.config import default_model

    if backend not in ("ring", "jaccl", "mpi"):
        raise UsageError(f"--backend {backend!r}: use ring, jaccl or mpi")
    if parallel not in ("pipeline", "tensor"):
        raise UsageError(f"--parallel {parallel!r}: use pipeline or tensor")
    if model is None:
        model = default_model()
        print(
            f"exokv: using {model} (choose a real one with --model PATH_OR_REPO or EXOKV_MODEL)",
            file=sys.stderr,
        )
    opts = ChatOptions(
        model=model,
        system=system,
        max_tokens=max_tokens,
        temp=temp,
        seed=seed,
        ranks=ranks,
        hosts=hosts,
        hostfile=hostfile,
        backend=backend,
        parallel=parallel,
        split=split,
        cache_budget=cache_budget,
        memory_threshold=memory_threshold,
        max_kv_size=max_kv_size,
        no_cache=no_cache,
        session=session,
        json=json_out,
        starting_port=starting_port,
    )
    raise typer.Exit(run_chat(opts))


@app.command()
def models(json_out: bool = typer.Option(False, "--json", help="one JSON document")) -> None:
    """List the builtin models and the models found locally."""
    import json

    from rich.console import Console
    from rich.table import Table

    from exokv.config import format_size
    from exokv.model.resolve import list_models

    found = list_models()
    if json_out:
        print(json.dumps(found, indent=2))
        return
    table = Table("name", "kind", "params", "size", "path")
    for m in found:
        size = format_size(m["size_bytes"]) if m.get("size_bytes") else "not generated yet"
        params = f"{m['params']:,}" if m.get("params") else "?"
        table.add_row(m["name"], m["kind"], params, size, str(m.get("path") or ""))
    Console().print(table)


def _mount_subcommands() -> None:
    # Each command lives in its own module; importing them here keeps cli.py thin.
    from exokv import inspect as inspect_cmds

    app.add_typer(inspect_cmds.cache_app, name="cache")
    from exokv.bench_cli import bench

    app.command()(bench)


def main() -> None:
    """Console entry point: one-line errors with exit codes, tracebacks only with EXOKV_DEBUG=1."""
    _mount_subcommands()
    try:
        code = app(standalone_mode=False)
    except ExokvError as err:
        if debug_enabled():
            traceback.print_exc()
        print(f"exokv: error: {err}", file=sys.stderr)
        sys.exit(err.exit_code)
    except (KeyboardInterrupt, typer.Abort, click.exceptions.Abort, EOFError):
        print("exokv: interrupted", file=sys.stderr)
        sys.exit(130)
    except (typer.Exit, click.exceptions.Exit) as err:
        sys.exit(err.exit_code)
    except Exception as err:  # noqa: BLE001 - the last line of defence: one line, exit 1
        if hasattr(err, "format_message") and isinstance(getattr(err, "exit_code", None), int):
            # A usage error from Typer's (vendored) click: its message and exit code, on
            # one line like every other exokv error.
            ctx = getattr(err, "ctx", None)
            where = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
            text = " ".join(str(err.format_message()).split())
            print(f"exokv: error: {text}{where}", file=sys.stderr)
            sys.exit(err.exit_code)
        if debug_enabled():
            traceback.print_exc()
        print(f"exokv: error: {err} (set EXOKV_DEBUG=1 for the traceback)", file=sys.stderr)
        sys.exit(1)
    if code == 130:  # Typer turns a KeyboardInterrupt into a silent exit code 130
        print("exokv: interrupted", file=sys.stderr)
    sys.exit(code if isinstance(code, int) else 0)
