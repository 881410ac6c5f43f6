"""The Typer app: parse, call, render, exit code. No computing here."""

from __future__ import annotations

import sys
import traceback

import click
import typer
import typer.core

from exokv import __version__
from exokv.chat.signals import Terminated
from exokv.config import debug_enabled
from exokv.errors import ExokvError, UsageError

app = typer.Typer(
    name="exokv",
    help="Chat with a model split across several Macs, with a rank-coherent KV prefix cache.",
    add_completion=False,
    pretty_exceptions_enable=False,
)

_display_type = typer.core.TyperOption.display_type_rich


def _no_type_on_flags(self: typer.core.TyperOption, ctx: click.Context) -> str | None:
    # Typer's rich help labels every option with its type; a plain flag (--json, --help)
    # takes no value, so `<bool>` beside it only misleads.
    return None if self.is_flag else _display_type(self, ctx)


typer.core.TyperOption.display_type_rich = _no_type_on_flags  # type: ignore[method-assign]
typer.core.TyperArgument.display_type_rich = (  # type: ignore[method-assign]
    lambda self, ctx: None  # an argument's metavar (PROMPT) says more than `<list[str]>`
)


def _print_version(value: bool) -> None:
    if value:
        print(f"exokv {__version__}")
        raise typer.Exit(0)


@app.callback(invoke_without_command=True)
def _root(
    ctx: typer.Context,
    version: bool = typer.Option(
        False,
        "--version",
        "-V",
        help="print the version and exit",
        callback=_print_version,
        is_eager=True,
    ),
) -> None:
    """Chat with a model split across several Macs, with a rank-coherent KV prefix cache."""
    if ctx.invoked_subcommand is None:
        print(ctx.get_help())
        raise typer.Exit(0)


@app.command()
def chat(
    prompt: list[str] = typer.Argument(
        None,
        metavar="PROMPT",
        help="a message to answer in one turn, then exit (as `llm` and `ollama run`)",
        show_default=False,
    ),
    model: str = typer.Option(
        None,
        "--model",
        "-m",
        help="smollm2 (default), builtin:NAME, a path, a .gguf, ollama:NAME or a HF repo id",
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
    disk_budget: str = typer.Option(
        None, "--disk-budget", help="disk tier per rank: 20GB, auto (a share of free space) or 0"
    ),
    kv_bits: int = typer.Option(None, "--kv-bits", help="quantized KV cache: 4 or 8 bits"),
    kv_group_size: int = typer.Option(64, "--kv-group-size", help="quantization group size"),
    session: str = typer.Option(
        None, "--session", help="name the conversation; resumes it if it exists"
    ),
    json_out: bool = typer.Option(False, "--json", help="script mode: one JSON object per turn"),
    starting_port: int = typer.Option(None, "--starting-port", help="first port for the ranks"),
) -> None:
    """Chat with the model: a REPL on a terminal, script mode otherwise; or one PROMPT."""
    from exokv.chat.resume import resolve
    from exokv.chat.run import ChatOptions, run_chat

    if backend not in ("ring", "jaccl", "mpi"):
        raise UsageError(f"--backend {backend!r}: use ring, jaccl or mpi")
    if parallel not in ("pipeline", "tensor"):
        raise UsageError(f"--parallel {parallel!r}: use pipeline or tensor")
    one_shot = " ".join(prompt or []).strip() or None
    if prompt and one_shot is None:
        raise UsageError("the PROMPT argument is empty: give a message, or no argument")
    settled = resolve(session, model, max_kv_size)
    model, max_kv_size = settled.model, settled.max_kv_size
    for note in settled.notes:
        print(f"exokv: {note}", file=sys.stderr)
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
        disk_budget=disk_budget,
        kv_bits=kv_bits,
        kv_group_size=kv_group_size,
        session=session,
        json=json_out,
        starting_port=starting_port,
        prompt=one_shot,
    )
    raise typer.Exit(run_chat(opts))


@app.command()
def models(json_out: bool = typer.Option(False, "--json", help="one JSON document")) -> None:
    """List the default model, the builtins and the models found locally (HF cache, ollama)."""
    import json

    from rich.console import Console

    from exokv.model.resolve import list_models, models_table

    found = list_models()
    if json_out:
        print(json.dumps(found, indent=2))
        return
    Console().print(models_table(found))
    print("smollm2 and builtin: models are made on first use; --json adds paths and sources")


@app.command()
def completions(
    shell: str = typer.Argument(..., metavar="SHELL", help="bash|zsh|fish"),
) -> None:
    """Print the shell completion script for bash, zsh or fish (install lines in the README)."""
    from exokv.completion import script

    print(script(shell), end="")


@app.command("_complete", hidden=True)
def _complete(kind: str = typer.Argument(..., metavar="KIND")) -> None:
    # What the completion scripts call for values known only at run time.
    from exokv.completion import values

    for value in values(kind):
        print(value)


_mounted = False


def _mount_subcommands() -> None:
    # Each command lives in its own module; importing them here keeps cli.py thin.
    global _mounted
    if _mounted:
        return
    _mounted = True
    from exokv import inspect as inspect_cmds
    from exokv.sessions_cli import sessions_app

    app.add_typer(inspect_cmds.cache_app, name="cache")
    app.add_typer(sessions_app, name="sessions")
    from exokv.bench_cli import bench

    app.command()(bench)


def main() -> None:
    """Console entry point: one-line errors with exit codes, tracebacks only with EXOKV_DEBUG=1."""
    if len(sys.argv) == 3 and sys.argv[1] == "_complete":
        # Every Tab after --model or --session runs this: skip loading the whole app.
        from exokv.completion import values

        for value in values(sys.argv[2]):
            print(value)
        return
    _mount_subcommands()
    try:
        code = app(standalone_mode=False, prog_name="exokv")
    except ExokvError as err:
        if debug_enabled():
            traceback.print_exc()
        print(f"exokv: error: {err}", file=sys.stderr)
        sys.exit(err.exit_code)
    except (KeyboardInterrupt, typer.Abort, click.exceptions.Abort, EOFError):
        print("exokv: interrupted", file=sys.stderr)
        sys.exit(130)
    except Terminated as err:
        print(f"exokv: {err}", file=sys.stderr)
        sys.exit(err.exit_code)
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
    if code == 130:
        # Typer turns a KeyboardInterrupt into a quiet `return 130`: say what happened.
        print("exokv: interrupted", file=sys.stderr)
    sys.exit(code if isinstance(code, int) else 0)
