"""What one host is: its versions, memory and free disk, as one JSON line.

Run on every host before a chat places layers (`--split auto`) and by `exokv hosts
check`: `python -m exokv.hostprobe` there (through exokv.wire.remote), or
`probe()` in-process for this machine. Nothing here loads a model or mlx's GPU
state: it must answer in well under a second on a busy Mac.
"""

from __future__ import annotations

import json
import platform
import shutil
import socket
import sys
from dataclasses import asdict, dataclass, fields
from importlib import metadata
from typing import Any

from exokv.config import exokv_home


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

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> HostFacts:
        data = json.loads(text)
        names = {f.name for f in fields(cls)}
        if not isinstance(data, dict) or not names <= set(data):
            raise ValueError(f"not a host's facts: {text[:80]!r}")
        return cls(**{k: data[k] for k in names})


# The distributions whose versions must agree between hosts (the ranks run the same code).
PACKAGES = ("exokv", "mlx", "mlx-lm")


def probe() -> HostFacts:
    import psutil

    vm = psutil.virtual_memory()
    home = exokv_home()
    while not home.exists() and home != home.parent:
        home = home.parent
    return HostFacts(
        hostname=socket.gethostname(),
        system=platform.system(),
        machine=platform.machine(),
        python=platform.python_version(),
        versions={name: _version(name) for name in PACKAGES},
        memory_total=int(vm.total),
        memory_available=int(vm.available),
        working_set=_working_set(),
        disk_free=int(shutil.disk_usage(home).free),
    )


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return ""


def _working_set() -> int | None:
    """Metal's limit on what the GPU keeps resident: on a Mac, the memory a model can use."""
    if sys.platform != "darwin":
        return None
    try:
        import mlx.core as mx

        info: dict[str, Any] = mx.metal.device_info()
        return int(info["max_recommended_working_set_size"])
    except Exception:  # noqa: BLE001 - an older mlx or no Metal device: the OS's numbers stand
        return None


def main() -> int:
    print(probe().to_json(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
