"""A GGUF conversion a person can watch and find again (issue 29).

Progress on stderr while it converts (a few lines in a log, one line redrawn on a
terminal); the conversion keyed by the file's bytes, so the same file at another
path or name uses it; `exokv models` lists it with its source files.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from chat_helpers import run_exokv
from gguf_helpers import write_gguf


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """builtin:tiny written as a Q5_0 GGUF (a type decoded in pieces), an empty models folder."""
    root = tmp_path_factory.mktemp("watch")
    home, models = root / "home", root / "models"
    subprocess.run(
        [sys.executable, "-c", "from exokv.model import builtin; builtin.ensure_builtin('tiny')"],
        env={**os.environ, "EXOKV_HOME": str(home)},
        check=True,
        timeout=180,
    )
    gguf = write_gguf(home / "models" / "tiny", root / "tiny-q5_0.gguf", "Q5_0")
    values = {"EXOKV_MODELS": str(models), "OLLAMA_MODELS": str(root / "ollama")}
    with pytest.MonkeyPatch.context() as mp:
        for key, value in values.items():
            mp.setenv(key, value)
        yield {"root": root, "home": home, "models": models, "gguf": gguf, "env": values}


def _chat(env: dict[str, Any], model: Path) -> tuple[str, str]:
    proc = run_exokv(
        ["chat", "--model", str(model), "--json", "--max-tokens", "4", "Hello there"],
        env["home"],
        env=env["env"],
    )
    assert proc.returncode == 0, proc.stderr.decode()
    return json.loads(proc.stdout)["reply"], proc.stderr.decode()


def _conversions(env: dict[str, Any]) -> list[Path]:
    return sorted(p for p in (env["models"] / "gguf").iterdir() if not p.name.startswith("."))


@pytest.mark.slow
def test_a_conversion_shows_progress_in_a_few_lines_then_is_found_by_content(
    env: dict[str, Any],
) -> None:
    first_reply, err = _chat(env, env["gguf"])
    lines = err.strip().splitlines()
    shown = [line for line in lines if "reading its tensors:" in line]
    assert any("converting" in line for line in lines), lines
    assert 1 <= len(shown) <= 3, lines  # a log gets a line a quarter at most
    assert all("%" in line and " of " in line for line in shown), shown
    assert "\r" not in err  # no terminal redraws in a log
    assert any(line.startswith("exokv: converted in") for line in lines), lines
    assert len(_conversions(env)) == 1

    # The same bytes under another name, elsewhere: no second conversion.
    elsewhere = env["root"] / "copies" / "renamed.gguf"
    elsewhere.parent.mkdir()
    shutil.copyfile(env["gguf"], elsewhere)
    reply, err = _chat(env, elsewhere)
    assert "converting" not in err and reply == first_reply
    assert len(_conversions(env)) == 1

    # Other bytes at a path already seen: converted again.
    changed = env["root"] / "copies" / "changed.gguf"
    shutil.copyfile(env["gguf"], changed)
    _, err = _chat(env, changed)
    assert "converting" not in err
    data = bytearray(changed.read_bytes())
    data[-1] ^= 0xFF  # the last weight's last byte
    changed.write_bytes(bytes(data))
    _, err = _chat(env, changed)
    assert "converting" in err
    assert len(_conversions(env)) == 2


@pytest.mark.slow
def test_models_lists_each_converted_gguf_with_its_source_files(env: dict[str, Any]) -> None:
    original, renamed = env["gguf"], env["root"] / "copies" / "renamed.gguf"
    if not renamed.exists():  # the test above makes it; this one may run alone
        renamed.parent.mkdir(exist_ok=True)
        shutil.copyfile(original, renamed)
    for model in (original, renamed):  # converted (or found) whichever test runs first
        _chat(env, model)
    proc = run_exokv(["models", "--json"], env["home"], env=env["env"])
    assert proc.returncode == 0, proc.stderr.decode()
    entries = [m for m in json.loads(proc.stdout) if m["kind"] == "gguf"]
    entry = next(m for m in entries if str(original) in m["sources"])
    assert entry["name"] == entry["source"] == str(original)
    assert set(entry["sources"]) >= {str(original), str(renamed)}
    assert Path(entry["path"]).parent == env["models"] / "gguf"
    assert entry["family"] == "qwen2" and entry["generated"] and entry["params"] > 0
    assert entry["quantization"] == "5-bit"
    table = run_exokv(["models"], env["home"], env=env["env"]).stdout.decode()
    assert any(line.startswith(original.name) for line in table.splitlines()), table


def test_a_piecewise_decode_equals_the_whole(
    env: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    import mlx.core as mx

    from exokv.model import gguf_read

    whole, _ = gguf_read.read_gguf(env["gguf"])
    monkeypatch.setattr(gguf_read, "_PIECE_BYTES", 100)  # a few rows a piece
    steps: list[tuple[int, int]] = []
    pieces, _ = gguf_read.read_gguf(env["gguf"], on_tensor=lambda d, t: steps.append((d, t)))
    assert whole.keys() == pieces.keys()
    assert all(mx.array_equal(whole[k], pieces[k]).item() for k in whole)
    total = steps[0][1]
    assert steps[0] == (0, total) and steps[-1] == (total, total)
    assert [d for d, _ in steps] == sorted(d for d, _ in steps)
    assert len(steps) > len(whole) // 3 + 1  # more steps than tensors: pieces were counted


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_on_a_terminal_one_line_is_redrawn_and_cleared() -> None:
    from exokv.model.progress import StepProgress

    screen = _Terminal()
    with StepProgress("reading its tensors", "reading x.gguf's metadata", screen) as shown:
        shown(0, 1000)
        shown.say("converting x.gguf for mlx-lm (once)")
        shown(1000, 1000)
    out = screen.getvalue()
    assert "exokv: converting x.gguf for mlx-lm (once)\n" in out
    assert "\r\x1b[2Kexokv: reading its tensors: 100% (1.0 KB of 1.0 KB" in out
    assert out.endswith("\r\x1b[2K")  # the line is gone once done
    assert out.count("\n") == 1  # the one line said, nothing else scrolls
