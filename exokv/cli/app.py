"""The Typer app: parse, call, render, exit code. No computing here."""

from __future__ import annotations

import json
import sys
import traceback
from typing import TYPE_CHECKING

import click
import typer
import typer.core

from exokv import __version__
from exokv.cli import flags
from exokv.cli.completion import script, values
from exokv.config import API_KEY, debug_enabled
from exokv.core.sizes import parse_size
from exokv.errors import ExokvError, UsageError
from exokv.frontend.signals import Terminated
from exokv.hosts.hostfile import parse_hosts, read_hostfile

if TYPE_CHECKING:
    from exokv.frontend.resume import Resolved

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


def _temperature(given: float | None, model_default: float | None) -> float:
    """--temp as given, else the model's own default (an ollama manifest's params), else 0."""
    if given is not None:
        return given
    return model_default if model_default is not None else 0.0


def _check_layout(backend: str, parallel: str, restarts: int, replicas: int | None) -> None:
    if backend not in ("ring", "jaccl", "mpi"):
        raise UsageError(f"--backend {backend!r}: use ring, jaccl or mpi")
    if parallel not in ("pipeline", "tensor"):
        raise UsageError(f"--parallel {parallel!r}: use pipeline or tensor")
    if restarts < 0:
        raise UsageError(f"--restarts {restarts}: use 0 or more")
    if replicas not in (None, 0, 1):
        raise UsageError(f"--replicas {replicas}: use 0 or 1")


# Long for its 29 option declarations: the body is short (issue 42).
@app.command()
def chat(
    prompt: list[str] = typer.Argument(
        None,
        metavar="PROMPT",
        help="a message to answer in one turn, then exit (as `llm` and `ollama run`)",
        show_default=False,
    ),
    model: str = flags.MODEL,
    system: str = flags.SYSTEM,
    chat_template: str = flags.CHAT_TEMPLATE,
    max_tokens: int = flags.MAX_TOKENS,
    temp: float = flags.TEMP,
    seed: int = flags.SEED,
    ranks: int = flags.RANKS,
    hosts: str = flags.HOSTS,
    hostfile: str = flags.HOSTFILE,
    backend: str = flags.BACKEND,
    parallel: str = flags.PARALLEL,
    split: str = flags.SPLIT,
    plan: bool = flags.PLAN,
    cache_budget: str = flags.CACHE_BUDGET,
    memory_threshold: float = flags.MEMORY_THRESHOLD,
    max_kv_size: int = flags.MAX_KV_SIZE,
    no_cache: bool = flags.NO_CACHE,
    no_typeahead: bool = typer.Option(
        False, "--no-typeahead", help="REPL: no prefill of the line before Enter"
    ),
    no_speculate: bool = flags.NO_SPECULATE,
    draft_model: str = flags.DRAFT_MODEL,
    disk_budget: str = flags.DISK_BUDGET,
    kv_bits: int = flags.KV_BITS,
    kv_group_size: int = flags.KV_GROUP_SIZE,
    session: str = typer.Option(
        None, "--session", help="name the conversation; resumes it if it exists"
    ),
    json_out: bool = typer.Option(False, "--json", help="script mode: one JSON object per turn"),
    plain: bool = typer.Option(
        False, "--plain", help="REPL: replies as raw text, not rendered as markdown"
    ),
    starting_port: int = flags.STARTING_PORT,
    restarts: int = flags.RESTARTS,
    replicas: int = flags.REPLICAS,
) -> None:
    """Chat with the model: a REPL on a terminal, script mode otherwise; or one PROMPT."""
    # deferred: the chat's start (client, store, exokv.model: ~0.1 s) only for `exokv chat`,
    # not for `--version`, `cache stats` or `_complete`
    from exokv.chat.run import run_chat
    from exokv.frontend.start import ChatOptions

    _check_layout(backend, parallel, restarts, replicas)
    one_shot = _one_shot(prompt)
    settled = _settled(session, model, max_kv_size, chat_template)
    if system is None and not settled.stored_system:
        system = settled.defaults.system  # an ollama model's SYSTEM, for a new session
    opts = ChatOptions(
        model=settled.model,
        system=system,
        max_tokens=max_tokens,
        temp=_temperature(temp, settled.defaults.temperature),
        max_kv_size=settled.max_kv_size,
        chat_template=settled.chat_template,
        prompt_format=settled.prompt_format,
        no_typeahead=no_typeahead,
        session=session,
        json=json_out,
        plain=plain,
        prompt=one_shot,
        **flags.passed_on(chat, locals()),
    )
    raise typer.Exit(run_chat(opts))


def _one_shot(prompt: list[str] | None) -> str | None:
    """`exokv chat PROMPT`'s message (its words joined), or None: no PROMPT."""
    one_shot = " ".join(prompt or []).strip() or None
    if prompt and one_shot is None:
        raise UsageError("the PROMPT argument is empty: give a message, or no argument")
    return one_shot


def _settled(
    session: str | None, model: str | None, max_kv_size: int | None, chat_template: str | None
) -> Resolved:
    """The model, --max-kv-size and template to run with (exokv.frontend.resume), its
    notes said on stderr."""
    # deferred: exokv.frontend.resume imports exokv.model (~0.1 s): only chat and serve
    from exokv.frontend.resume import resolve
    from exokv.state.locks import SessionLocks

    if session:  # a session open elsewhere is refused in one line, before "resuming ..."
        SessionLocks().check(session)
    settled = resolve(session, model, max_kv_size, chat_template)
    for note in settled.notes:
        print(f"exokv: {note}", file=sys.stderr)
    return settled


# Long for its 31 option declarations: the body is short (issue 42).
@app.command()
def serve(
    model: str = flags.MODEL,
    max_tokens: int = typer.Option(
        256, "--max-tokens", help="reply length for a request without max_tokens"
    ),
    temp: float = typer.Option(
        None, "--temp", help="temperature for a request without one (0, or an ollama model's)"
    ),
    chat_template: str = flags.CHAT_TEMPLATE,
    seed: int = flags.SEED,
    ranks: int = flags.RANKS,
    hosts: str = flags.HOSTS,
    hostfile: str = flags.HOSTFILE,
    backend: str = flags.BACKEND,
    parallel: str = flags.PARALLEL,
    split: str = flags.SPLIT,
    plan: bool = flags.PLAN,
    cache_budget: str = flags.CACHE_BUDGET,
    memory_threshold: float = flags.MEMORY_THRESHOLD,
    max_kv_size: int = flags.MAX_KV_SIZE,
    no_cache: bool = flags.NO_CACHE,
    no_speculate: bool = flags.NO_SPECULATE,
    draft_model: str = flags.DRAFT_MODEL,
    disk_budget: str = flags.DISK_BUDGET,
    kv_bits: int = flags.KV_BITS,
    kv_group_size: int = flags.KV_GROUP_SIZE,
    starting_port: int = flags.STARTING_PORT,
    restarts: int = flags.RESTARTS,
    replicas: int = flags.REPLICAS,
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
        None,
        "--batch",
        help="requests decoded together at most (default: what memory holds; 1: one at a time)",
    ),
    batch_wait: float = typer.Option(
        10.0, "--batch-wait", help="ms a batch's first request waits for others (0: none)"
    ),
    drain_timeout: float = typer.Option(
        30.0, "--drain-timeout", help="seconds in-flight requests get on SIGTERM/Ctrl-C"
    ),
    max_body: str = typer.Option("1MB", "--max-body", help="largest request body (413 above)"),
    allow_origin: list[str] = typer.Option(
        None,
        "--allow-origin",
        metavar="ORIGIN",
        help="a browser page's origin allowed to call the API (CORS): repeat, or a,b; '*': any",
    ),
) -> None:
    """Serve the model over an OpenAI-compatible HTTP API, with the chat's ranks and cache."""
    # deferred: the server's start (client, store, exokv.model: ~0.1 s) only for
    # `exokv serve`, not for `--version`, `cache stats` or `_complete`
    from exokv.frontend.start import ChatOptions
    from exokv.serve.run import ServeOptions, origins, run_serve

    _check_layout(backend, parallel, restarts, replicas)
    settled = _settled(None, model, max_kv_size, chat_template)
    front = ChatOptions(
        model=settled.model,
        max_tokens=max_tokens,
        temp=_temperature(temp, settled.defaults.temperature),
        system=settled.defaults.system,  # for a request without a system message
        max_kv_size=max_kv_size,
        chat_template=settled.chat_template,
        prompt_format=settled.prompt_format,
        **flags.passed_on(serve, locals()),
    )
    opts = ServeOptions(
        front,
        host=host,
        port=port,
        api_key=api_key,
        queue=queue,
        batch=batch,
        batch_wait_ms=batch_wait,
        drain_s=drain_timeout,
        max_body=parse_size(max_body),
        allow_origins=origins(allow_origin),
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
    # deferred: rich (0.02 s) only for `exokv models`, not for `exokv _complete` (every Tab)
    from rich.console import Console

    # deferred: exokv.model (~0.1 s) likewise
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
    # deferred: rich (0.02 s) only for `exokv models`, not for `exokv _complete` (every Tab)
    from rich.console import Console

    # deferred: the ssh listing and exokv.model (~0.1 s) likewise
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
    print(script(shell), end="")


@app.command("_complete", hidden=True)
def _complete(kind: str = typer.Argument(..., metavar="KIND")) -> None:
    # What the completion scripts call for values known only at run time.
    for value in values(kind):
        print(value)


_mounted = False


def _mount_subcommands() -> None:
    # Each command lives in its own module; importing them here keeps cli/app.py thin.
    global _mounted
    if _mounted:
        return
    _mounted = True
    # deferred: the subcommands' modules (rich, psutil, the store, the host probes: ~0.1 s)
    # are mounted by main() after the `_complete` shortcut, run on every Tab, has returned
    from exokv.cli import cache as cache_cli
    from exokv.cli.bench import bench
    from exokv.cli.hosts import hosts_app
    from exokv.cli.sessions import sessions_app

    app.add_typer(cache_cli.cache_app, name="cache")
    app.add_typer(sessions_app, name="sessions")
    app.add_typer(hosts_app, name="hosts")
    app.command()(bench)


def main() -> None:
    """Console entry point: one-line errors with exit codes, tracebacks only with EXOKV_DEBUG=1."""
    if len(sys.argv) == 3 and sys.argv[1] == "_complete":
        # Every Tab after --model or --session runs this: skip loading the whole app.
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
