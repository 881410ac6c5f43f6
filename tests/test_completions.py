"""The shell completions are generated from the Typer app and must stay current and valid."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gen_completions.py"
COMPLETIONS = ROOT / "completions"


def _generator():
    spec = importlib.util.spec_from_file_location("gen_completions", SCRIPT)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_completions_are_current() -> None:
    rendered = _generator().render_all()
    stale = [p.name for p, text in rendered.items() if not p.exists() or p.read_text() != text]
    assert not stale, (
        f"completions are stale ({', '.join(stale)}): run `python scripts/gen_completions.py` "
        "and commit completions/"
    )


def test_completions_cover_every_command() -> None:
    tree = _generator().load_tree()
    paths = {c.path for c in tree}
    assert {"exokv cache stats", "exokv cache evictions", "exokv cache clear"} <= paths
    bash = (COMPLETIONS / "exokv.bash").read_text()
    for cmd in tree:
        assert f'"{cmd.path}")' in bash, cmd.path


@pytest.mark.parametrize("shell", ["bash", "zsh", "fish"])
def test_completion_syntax(shell: str) -> None:
    exe = shutil.which(shell)
    if exe is None:
        # bash is always checked; zsh and fish only where they are installed.
        assert shell != "bash", "bash is needed to check completions/exokv.bash"
        pytest.skip(f"{shell} is not installed")
    proc = subprocess.run(
        [exe, "-n", str(COMPLETIONS / f"exokv.{shell}")],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 0, proc.stderr


def _bash_complete(line: str) -> list[str]:
    words = line.split(" ")
    script = (
        f"source {COMPLETIONS / 'exokv.bash'}\n"
        f"COMP_WORDS=({' '.join(repr(w) for w in words)})\n"
        f"COMP_CWORD={len(words) - 1}\n"
        "_exokv_completion\n"
        'printf "%s\\n" "${COMPREPLY[@]}"\n'
    )
    proc = subprocess.run(
        ["bash", "--norc", "-c", script], capture_output=True, text=True, timeout=30
    )
    assert proc.returncode == 0, proc.stderr
    return [w for w in proc.stdout.splitlines() if w]


def test_bash_completes_commands_options_and_values() -> None:
    assert "cache" in _bash_complete("exokv ")
    assert _bash_complete("exokv cache ev") == ["evictions"]
    assert "--since" in _bash_complete("exokv cache evictions --rank 1 --")
    # After an option that takes a value, no command or option is offered.
    assert _bash_complete("exokv cache evictions --limit ") == []
