"""What one host is: its versions, memory and free disk, as one JSON line.

Run on every host before a chat places layers (`--split auto`) and by `exokv hosts
check`: `python -m exokv.hosts.probe [--model M]` there (through exokv.launch.remote),
or `probe()` in-process for this machine. Nothing here loads a model or mlx's GPU
state, generates, converts or downloads anything: it must answer in well under a
second on a busy Mac. With a model it also says whether that model is there
(`ModelPresence`).
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import socket
import sys
from dataclasses import MISSING, asdict, dataclass, fields
from importlib import metadata
from pathlib import Path
from typing import Any

import psutil

from exokv.config import TEST_HOOKS, exokv_home
from exokv.core.sizes import format_size
from exokv.errors import ExokvError


@dataclass
class ModelPresence:
    """Whether a --model value resolves on a host without a download.

    `status`: "here" (on disk, ready), "first-use" (a builtin generated or a GGUF
    converted on first use, from what is on this host), "fetch" (not here, but a
    chat fetches it: `fetch_files`/`fetch_bytes` say how much when known),
    "missing" (a chat would refuse it here) or "invalid" (no such model anywhere).
    """

    name: str
    status: str
    detail: str  # one line: where it is, or why it is not
    path: str = ""
    fix: str = ""  # what to do there when it is missing
    fetch_files: int | None = None  # what a chat would download onto this host
    fetch_bytes: int | None = None

    @property
    def ok(self) -> bool:
        return self.status in ("here", "first-use", "fetch")

    def summary(self) -> str:
        """The model column of `exokv hosts check`."""
        if self.status == "fetch" and self.fetch_files is not None:
            size = format_size(self.fetch_bytes or 0)
            return f"would fetch {self.fetch_files} files, {size}"
        return {"here": "here", "first-use": "on first use", "fetch": "fetched on first use"}.get(
            self.status, self.status
        )


@dataclass
class HostFacts:
    hostname: str
    system: str  # platform.system(): "Darwin", "Linux"
    machine: str  # "arm64", "x86_64"
    python: str  # "3.11.9"
    versions: dict[str, str]  # distribution -> version ("" when not installed)
    memory_total: int  # bytes
    memory_available: int  # bytes the OS could give now
    working_set: int | None  # Metal's recommended working set (bytes); None off a Mac
    disk_free: int  # bytes free where exokv keeps its state (EXOKV_HOME, or its parent)
    disk_total: int = 0  # bytes, the same disk
    model: ModelPresence | None = None  # asked for with --model

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> HostFacts:
        """The facts a probe printed; a field added since (an older exokv there) takes its
        default, so the version mismatch is what gets reported."""
        data = json.loads(text)
        required = {f.name for f in fields(cls) if f.default is MISSING}
        if not isinstance(data, dict) or not required <= set(data):
            raise ValueError(f"not a host's facts: {text[:80]!r}")
        known = {k: data[k] for k in (f.name for f in fields(cls)) if k in data}
        model = known.get("model")
        if isinstance(model, dict):
            names = {f.name for f in fields(ModelPresence)}
            known["model"] = ModelPresence(**{k: v for k, v in model.items() if k in names})
        return cls(**known)


# The distributions whose versions must agree between hosts (the ranks run the same code).
PACKAGES = ("exokv", "mlx", "mlx-lm")


def probe(model: str | None = None) -> HostFacts:
    """This machine's facts; with `model`, whether that model is here too."""
    vm = psutil.virtual_memory()
    home = exokv_home()
    while not home.exists() and home != home.parent:
        home = home.parent
    disk = shutil.disk_usage(home)
    fake = _fake_versions()
    return HostFacts(
        hostname=socket.gethostname(),
        system=platform.system(),
        machine=platform.machine(),
        python=fake.get("python", platform.python_version()),
        versions={name: fake.get(name, _version(name)) for name in PACKAGES},
        memory_total=int(vm.total),
        memory_available=int(vm.available),
        working_set=_working_set(),
        disk_free=int(disk.free),
        disk_total=int(disk.total),
        model=model_presence(model) if model is not None else None,
    )


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return ""


def _fake_versions() -> dict[str, str]:
    """EXOKV_TEST_FAKE_VERSIONS: a JSON file of versions this host claims (a test's
    mismatch, as all test hosts share one venv); `~` is this host's own HOME."""
    path = TEST_HOOKS.fake_versions()
    if path is None:
        return {}
    try:
        data = json.loads(Path(path).expanduser().read_text())
    except FileNotFoundError:
        return {}  # only the hosts whose HOME has the file differ
    except (OSError, ValueError) as err:
        raise SystemExit(f"exokv: error: cannot read the fake versions {path}: {err}") from None
    return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}


def model_presence(name: str) -> ModelPresence:
    """Where `name` (a --model value) stands on this host, found without side effects:
    the same kinds, in the same order, as exokv.model.resolve.resolve_model."""
    # deferred: exokv.model (~40 ms on a host over ssh) only with --model
    from exokv.model import hub, resolve
    from exokv.model.packaged import MODELS as PACKAGED

    name = name.strip()
    if not name:
        return ModelPresence(name, "invalid", "an empty model name")
    if name in PACKAGED:
        packaged = PACKAGED[name]
        if (packaged.converted() / "config.json").is_file():
            return ModelPresence(name, "here", "converted", str(packaged.converted()))
        if packaged.gguf().is_file():
            return ModelPresence(name, "first-use", "its GGUF is here: converted on first use")
        return ModelPresence(name, "fetch", f"fetched from {packaged.source} on first use")
    if name.startswith(resolve.OLLAMA_PREFIX):
        return _gguf_presence(name, lambda: _ollama_blob(name[len(resolve.OLLAMA_PREFIX) :]))
    if name.startswith(resolve.BUILTIN_PREFIX):
        try:
            short = resolve.builtin_name(name)  # the one list of builtin and zoo names
        except Exception as err:  # noqa: BLE001 - UsageError: its line says which names exist
            return ModelPresence(name, "invalid", str(err))
        assert short is not None
        if resolve.generated_marker(short) is not None:
            return ModelPresence(name, "here", "generated")
        return ModelPresence(name, "first-use", "generated on first use")
    local = Path(name).expanduser()
    if local.is_dir():
        if (local / "config.json").is_file():
            return ModelPresence(name, "here", "a model directory", str(local))
        fix = "convert it with `mlx_lm.convert`, or copy the model to that path there"
        return ModelPresence(name, "missing", f"{local} has no config.json", fix=fix)
    if local.exists():
        return _gguf_presence(name, lambda: local)
    if hub.parse_name(name) is not None:
        return _hub_presence(name)
    fix = "copy it to the same path there"
    return ModelPresence(name, "missing", f"no such directory or file: {local}", fix=fix)


def _ollama_blob(ref: str) -> Path:
    from exokv.model import ollama  # deferred, as in model_presence: only with --model

    return ollama.blob_of(ref)


def _gguf_presence(name: str, blob: Any) -> ModelPresence:
    # deferred, as in model_presence: only with --model
    from exokv.model.gguf_models import converted_dir
    from exokv.model.gguf_read import is_gguf

    try:
        gguf: Path = blob()
    except Exception as err:  # noqa: BLE001 - ExokvError/UsageError: their one line
        return ModelPresence(name, "missing", str(err))
    if not is_gguf(gguf):
        return ModelPresence(name, "invalid", f"{gguf} is a file but not a GGUF file")
    out = converted_dir(gguf)
    if (out / "config.json").is_file():
        return ModelPresence(name, "here", "converted", str(out))
    return ModelPresence(name, "first-use", "a GGUF here: converted on first use", str(gguf))


def _hub_presence(name: str) -> ModelPresence:
    """A hub repo (ORG/NAME[@REVISION]): whole in this host's Hugging Face cache, or what
    a chat would fetch onto it (the hub asked for its file list; only the small config,
    tokenizer and index files are downloaded, to read which shards the model has)."""
    from exokv.model import hub  # deferred, as in model_presence: only with --model

    parsed = hub.parse_name(name)
    assert parsed is not None
    repo, revision = parsed
    try:
        plan = hub.fetch(repo, revision, hub.Want(), bars=False, dry_run=True)
    except ExokvError as err:  # unreachable, no such repo or revision: the hub's one line
        where = f"not in this host's Hugging Face cache ({hub.hf_cache_dir()}): {err}"
        return ModelPresence(name, "missing", where, fix=f"run `hf download {repo}` there")
    if not plan.fetched:
        where = f"in the Hugging Face cache ({len(plan.files)} files)"
        return ModelPresence(name, "here", where, str(plan.path))
    where = "a chat fetches the files its layers need (at most these)"
    return ModelPresence(
        name, "fetch", where, fetch_files=len(plan.fetched), fetch_bytes=plan.bytes
    )


def _working_set() -> int | None:
    """Metal's limit on what the GPU keeps resident: on a Mac, the memory a model can use."""
    if sys.platform != "darwin":
        return None
    try:
        import mlx.core as mx  # deferred: a Mac's only; a host without mlx still answers

        info: dict[str, Any] = mx.metal.device_info()
        return int(info["max_recommended_working_set_size"])
    except Exception:  # noqa: BLE001 - an older mlx or no Metal device: the OS's numbers stand
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="exokv.hosts.probe")
    parser.add_argument("--model", default=None, help="also say whether this model is here")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    print(probe(args.model).to_json(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
