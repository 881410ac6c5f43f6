"""The Typer app: parse, call, render, exit code. No computing here."""

from __future__ import annotations

import sys
import traceback

import click
import typer

from exokv.config import debug_enabled
from exokv.errors import ExokvError

app = typer.Typer(
    name="exokv",
    help="Chat with a model split across several Macs, with a rank-coherent KV prefix cache.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _mount_subcommands() -> None:
    # Each command lives in its own module; importing them here keeps cli.py thin.
    from exokv import inspect as inspect_cmds

    app.add_typer(inspect_cmds.cache_app, name="cache")


def main() -> None:
    """Console entry point: one-line errors with exit codes, tracebacks only with EXOKV_DEBUG=1."""
    _mount_subcommands()
    try:
        code = app(standalone_mode=False)
    except click.ClickException as err:
        err.show()
        sys.exit(err.exit_code)
    except (click.exceptions.Abort, EOFError):
        print("exokv: aborted", file=sys.stderr)
        sys.exit(1)
    except click.exceptions.Exit as err:
        sys.exit(err.exit_code)
    except ExokvError as err:
        if debug_enabled():
            traceback.print_exc()
        print(f"exokv: error: {err}", file=sys.stderr)
        sys.exit(err.exit_code)
    except KeyboardInterrupt:
        print("exokv: interrupted", file=sys.stderr)
        sys.exit(130)
    except Exception as err:  # noqa: BLE001 - the last line of defence: one line, exit 1
        if debug_enabled():
            traceback.print_exc()
        print(f"exokv: error: {err} (set EXOKV_DEBUG=1 for the traceback)", file=sys.stderr)
        sys.exit(1)
    sys.exit(code if isinstance(code, int) else 0)
