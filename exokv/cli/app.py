"""The Typer app: parse, call, render, exit code. No computing here."""

from __future__ import annotations

import sys
import traceback
from typing import Any

import click
import typer
import typer.core

from exokv import __version__
from exokv.config import API_KEY, debug_enabled
from exokv.errors import ExokvError, UsageError
from exokv.frontend.signals import Terminated

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


# The chat's model, layout and cache options, shared with `exokv serve` (one definition
# each: the two front ends start the same ranks the same way).
_MODEL = typer.Option(
    None,
    "--model",
    "-m",
    help="smollm2 (default), builtin:NAME, a path, a .gguf, ollama:NAME or a HF repo id",
)
_SYSTEM = typer.Option(None, "--system", help="system prompt")
_CHAT_TEMPLATE = typer.Option(
    None,
    "--chat-template",
    help="chatml|llama3|gemma|mistral|qwen|phi|plain or a Jinja file (default: the model's)",
)
_MAX_TOKENS = typer.Option(256, "--max-tokens", help="most tokens per reply")
_TEMP = typer.Option(
    None, "--temp", help="sampling temperature (default 0, or an ollama model's own)"
)
_SEED = typer.Option(None, "--seed", help="random seed")
_RANKS = typer.Option(1, "--ranks", "-n", help="ranks on this machine")
_HOSTS = typer.Option(None, "--hosts", help="a,b,... one rank per host")
_HOSTFILE = typer.Option(None, "--hostfile", help="mlx hostfile (JSON)")
_BACKEND = typer.Option("ring", "--backend", help="ring|jaccl|mpi")
_PARALLEL = typer.Option("pipeline", "--parallel", help="pipeline|tensor")
_SPLIT = typer.Option(
    None, "--split", help="layers per rank: auto (from memory; the default) or e.g. 3,1"
)
_PLAN = typer.Option(
    False, "--plan", help="print where the layers and cache go, then exit (loads no weights)"
)
_CACHE_BUDGET = typer.Option(None, "--cache-budget", help="bytes per rank: 2GB or 64MB,16MB")
_MEMORY_THRESHOLD = typer.Option(
    0.9, "--memory-threshold", help="RAM fraction that triggers eviction"
)
_MAX_KV_SIZE = typer.Option(None, "--max-kv-size", help="rotating KV cache of this many tokens")
_NO_CACHE = typer.Option(False, "--no-cache", help="prefill the whole prompt every turn")
_DISK_BUDGET = typer.Option(
    None, "--disk-budget", help="disk tier per rank: 20GB, auto (a share of free space) or 0"
)
_KV_BITS = typer.Option(None, "--kv-bits", help="quantized KV cache: 4 or 8 bits")
_KV_GROUP_SIZE = typer.Option(64, "--kv-group-size", help="quantization group size")
_NO_SPECULATE = typer.Option(
    False, "--no-speculate", help="decode one token at a time, no drafts from the conversation"
)
_STARTING_PORT = typer.Option(None, "--starting-port", help="first port for the ranks")
_DRAFT_MODEL = typer.Option(
    None,
    "--draft-model",
    help="a small model with the model's tokenizer that drafts replies on rank 0 (as --model)",
)
_RESTARTS = typer.Option(
    3, "--restarts", help="a rank that dies: start the ranks again, up to N tries (0: end)"
)


# The options above that go to ChatOptions under their own names, for both commands.
_SHARED = (
    "seed",
    "ranks",
    "hosts",
    "hostfile",
    "backend",
    "parallel",
    "split",
    "plan",
    "cache_budget",
    "memory_threshold",
    "no_cache",
    "no_speculate",
    "disk_budget",
    "kv_bits",
    "kv_group_size",
    "starting_port",
    "restarts",
    "draft_model",
)


def _shared(values: dict[str, Any]) -> dict[str, Any]:
    """The shared model, layout and cache options among a command's parameters."""
    return {name: values[name] for name in _SHARED}


def _temperature(given: float | None, model_default: float | None) -> float:
    """--temp as given, else the model's own default (an ollama manifest's params), else 0."""
    if given is not None:
        return given
    return model_default if model_default is not None else 0.0


def _check_layout(backend: str, parallel: str, restarts: int) -> None:
    if backend not in ("ring", "jaccl", "mpi"):
        raise UsageError(f"--backend {backend!r}: use ring, jaccl or mpi")
    if parallel not in ("pipeline", "tensor"):
        raise UsageError(f"--parallel {parallel!r}: use pipeline or tensor")
    if restarts < 0:
        raise UsageError(f"--restarts {restarts}: use 0 or more")


@app.command()
def chat(
    prompt: list[str] = typer.Argument(
        None,
        metavar="PROMPT",
        help="a message to answer in one turn, then exit (as `llm` and `ollama run`)",
        show_default=False,
    ),
    model: str = _MODEL,
    system: str = _SYSTEM,
    chat_template: str = _CHAT_TEMPLATE,
    max_tokens: int = _MAX_TOKENS,
    temp: float = _TEMP,
    seed: int = _SEED,
    ranks: int = _RANKS,
    hosts: str = _HOSTS,
    hostfile: str = _HOSTFILE,
    backend: str = _BACKEND,
    parallel: str = _PARALLEL,
    split: str = _SPLIT,
    plan: bool = _PLAN,
    cache_budget: str = _CACHE_BUDGET,
    memory_threshold: float = _MEMORY_THRESHOLD,
    max_kv_size: int = _MAX_KV_SIZE,
    no_cache: bool = _NO_CACHE,
    no_typeahead: bool = typer.Option(
        False, "--no-typeahead", help="REPL: no prefill of the line before Enter"
    ),
    no_speculate: bool = _NO_SPECULATE,
    draft_model: str = _DRAFT_MODEL,
    disk_budget: str = _DISK_BUDGET,
    kv_bits: int = _KV_BITS,
    kv_group_size: int = _KV_GROUP_SIZE,
    session: str = typer.Option(
        None, "--session", help="name the conversation; resumes it if it exists"
    ),
    json_out: bool = typer.Option(False, "--json", help="script mode: one JSON object per turn"),
    plain: bool = typer.Option(
        False, "--plain", help="REPL: replies as raw text, not rendered as markdown"
    ),
    starting_port: int = _STARTING_PORT,
    restarts: int = _RESTARTS,
) -> None:
    """Chat with the model: a REPL on a terminal, script mode otherwise; or one PROMPT."""
    from exokv.chat.run import run_chat
    from exokv.frontend.resume import resolve
    from exokv.frontend.start import ChatOptions

    _check_layout(backend, parallel, restarts)
    one_shot = " ".join(prompt or []).strip() or None
    if prompt and one_shot is None:
        raise UsageError("the PROMPT argument is empty: give a message, or no argument")
    settled = resolve(session, model, max_kv_size, chat_template)
    model, max_kv_size = settled.model, settled.max_kv_size
    for note in settled.notes:
        print(f"exokv: {note}", file=sys.stderr)
    defaults = settled.defaults
    if system is None and not settled.stored_system:
        system = defaults.system  # an ollama model's SYSTEM, for a new session
    opts = ChatOptions(
        model=model,
        system=system,
        max_tokens=max_tokens,
        temp=_temperature(temp, defaults.temperature),
        max_kv_size=max_kv_size,
        chat_template=settled.chat_template,
        prompt_format=settled.prompt_format,
        no_typeahead=no_typeahead,
        session=session,
        json=json_out,
        plain=plain,
        prompt=one_shot,
        **_shared(locals()),
    )
    raise typer.Exit(run_chat(opts))


@app.command()
def serve(
    model: str = _MODEL,
    max_tokens: int = typer.Option(
        256, "--max-tokens", help="reply length for a request without max_tokens"
    ),
    temp: float = typer.Option(
        None, "--temp", help="temperature for a request without one (0, or an ollama model's)"
    ),
    chat_template: str = _CHAT_TEMPLATE,
    seed: int = _SEED,
    ranks: int = _RANKS,
    hosts: str = _HOSTS,
    hostfile: str = _HOSTFILE,
    backend: str = _BACKEND,
    parallel: str = _PARALLEL,
    split: str = _SPLIT,
    plan: bool = _PLAN,
    cache_budget: str = _CACHE_BUDGET,
    memory_threshold: float = _MEMORY_THRESHOLD,
    max_kv_size: int = _MAX_KV_SIZE,
    no_cache: bool = _NO_CACHE,
    no_speculate: bool = _NO_SPECULATE,
    draft_model: str = _DRAFT_MODEL,
    disk_budget: str = _DISK_BUDGET,
    kv_bits: int = _KV_BITS,
    kv_group_size: int = _KV_GROUP_SIZE,
    starting_port: int = _STARTING_PORT,
    restarts: int = _RESTARTS,
    host: str = typer.Option("127.0.0.1", "--host", help="address to listen on (loopback)"),
    port: int = typer.Option(8000, "--port", help="port to listen on"),
    api_key: str = typer.Option(
        None,
        "--api-key",
        envvar=API_KEY.name,
        help=f"require 'Authorization: Bearer KEY' (or set {API_KEY.name})",
    ),
    queue: int = typer.Option(64, "--queue", help="requests that may wait; more get 503"),
    batch: int = typer.Option(
        8, "--batch", help="requests decoded together at most (1: one at a time)"
    ),
    batch_wait: float = typer.Option(
        10.0, "--batch-wait", help="ms a batch's first request waits for others (0: none)"
    ),
    drain_timeout: float = typer.Option(
        30.0, "--drain-timeout", help="seconds in-flight requests get on SIGTERM/Ctrl-C"
    ),
    max_body: str = typer.Option("1MB", "--max-body", help="largest request body (413 above)"),
) -> None:
    """Serve the model over an OpenAI-compatible HTTP API, with the chat's ranks and cache."""
    from exokv.core.sizes import parse_size
    from exokv.frontend.resume import resolve
    from exokv.serve.run import ServeOptions, run_serve

    _check_layout(backend, parallel, restarts)
    settled = resolve(None, model, max_kv_size, chat_template)
    for note in settled.notes:
        print(f"exokv: {note}", file=sys.stderr)
    opts = ServeOptions(
        model=settled.model,
        max_tokens=max_tokens,
        temp=_temperature(temp, settled.defaults.temperature),
        system=settled.defaults.system,  # for a request without a system message
        max_kv_size=max_kv_size,
        chat_template=settled.chat_template,
        prompt_format=settled.prompt_format,
        host=host,
        port=port,
        api_key=api_key,
        queue=queue,
        batch=batch,
        batch_wait_ms=batch_wait,
        drain_s=drain_timeout,
        max_body=parse_size(max_body),
        **_shared(locals()),
    )
    raise typer.Exit(run_serve(opts))


@app.command()
def models(
    json_out: bool = typer.Option(False, "--json", help="one JSON document"),
    hosts: str = typer.Option(None, "--hosts", help="a,b,... list what each host holds"),
    hostfile: str = typer.Option(None, "--hostfile", help="mlx hostfile (JSON): each host's"),
) -> None:
    """List the default model, the builtins and the models found locally (HF cache, ollama);
    with --hosts/--hostfile, what each host holds, read on that host."""
    import json

    from rich.console import Console

    from exokv.model.catalogue import list_models, models_table

    if hosts or hostfile:
        _models_per_host(hosts, hostfile, json_out)
        return
    found = list_models()
    if json_out:
        print(json.dumps(found, indent=2))
        return
    Console().print(models_table(found))
    print("smollm2, gemma3-270m, builtin: made on first use; --json adds paths and sources")


def _models_per_host(hosts: str | None, hostfile: str | None, json_out: bool) -> None:
    import json

    from rich.console import Console

    from exokv.errors import UsageError
    from exokv.hosts.hostfile import parse_hosts, read_hostfile
    from exokv.hosts.listing import models_on_hosts
    from exokv.model.catalogue import models_table

    if hosts and hostfile:
        raise UsageError("use --hosts or --hostfile, not both")
    found = models_on_hosts(read_hostfile(hostfile) if hostfile else parse_hosts(hosts or ""))
    if json_out:
        doc = [{"host": f.host, "models": f.models, "error": f.error or None} for f in found]
        print(json.dumps({"hosts": doc}, indent=2))
    else:
        console = Console()
        for f in found:
            if f.models is not None:
                console.print(f"[bold]{f.host}[/bold]")
                console.print(models_table(f.models))
    failed = [f for f in found if f.models is None]
    for f in failed:
        print(f"exokv: {f.host}: could not list its models: {f.error}", file=sys.stderr)
    if failed:
        raise typer.Exit(1)


@app.command()
def completions(
    shell: str = typer.Argument(..., metavar="SHELL", help="bash|zsh|fish"),
) -> None:
    """Print the shell completion script for bash, zsh or fish (install lines in the README)."""
    from exokv.cli.completion import script

    print(script(shell), end="")


@app.command("_complete", hidden=True)
def _complete(kind: str = typer.Argument(..., metavar="KIND")) -> None:
    # What the completion scripts call for values known only at run time.
    from exokv.cli.completion import values

    for value in values(kind):
        print(value)


_mounted = False


def _mount_subcommands() -> None:
    # Each command lives in its own module; importing them here keeps cli/app.py thin.
    global _mounted
    if _mounted:
        return
    _mounted = True
    from exokv.cli import cache as cache_cli
    from exokv.cli.sessions import sessions_app

    app.add_typer(cache_cli.cache_app, name="cache")
    app.add_typer(sessions_app, name="sessions")
    from exokv.cli.hosts import hosts_app

    app.add_typer(hosts_app, name="hosts")
    from exokv.cli.bench import bench

    app.command()(bench)


def main() -> None:
    """Console entry point: one-line errors with exit codes, tracebacks only with EXOKV_DEBUG=1."""
    if len(sys.argv) == 3 and sys.argv[1] == "_complete":
        # Every Tab after --model or --session runs this: skip loading the whole app.
        from exokv.cli.completion import values

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
