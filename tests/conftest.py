"""Shared fixtures for the test suite."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models import qwen2
from ssh_hosts import ssh_hosts, three_hosts  # noqa: F401 - the ssh hosts, for any test module

# pytest-xdist's workers have COLUMNS=80 and LINES=24 in their environment; the
# processes tests start (some in pseudo-terminals of their own size) must not inherit
# them, or every table and status line is cut at 80 columns.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.pop("COLUMNS", None)
    os.environ.pop("LINES", None)

# A suite started in the background by a non-interactive shell inherits SIGINT ignored,
# and so would every exokv it starts (Python installs no KeyboardInterrupt handler for
# an ignored SIGINT): the Ctrl-C tests would test nothing. Catching it here makes the
# children start with the default disposition, as from a terminal.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# -- tiny in-memory models ----------------------------------------------------------


def build_tiny_qwen(**overrides) -> qwen2.Model:
    """A small random qwen2 built in memory (no files, no tokenizer), float32.

    Every 2-D weight is multiplied by 3: at the default init scale the network is
    close to a constant function of its input, and the cache tests need logits
    that depend on every earlier token.
    """
    config = dict(
        model_type="qwen2",
        hidden_size=64,
        num_hidden_layers=4,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-6,
        vocab_size=300,
        tie_word_embeddings=True,
    )
    config.update(overrides)
    mx.random.seed(0)
    model = qwen2.Model(qwen2.ModelArgs(**config))
    scaled = [(k, v * 3 if v.ndim == 2 else v) for k, v in tree_flatten(model.parameters())]
    model.update(tree_unflatten(scaled))
    mx.eval(model.parameters())
    model.eval()
    return model


@pytest.fixture(scope="session")
def tiny_qwen() -> qwen2.Model:
    """hidden 64, 4 layers, 4 heads (head dim 16), 2 kv heads, vocab 300."""
    return build_tiny_qwen()


@pytest.fixture(scope="session")
def tiny_qwen_hd32() -> qwen2.Model:
    """tiny_qwen with 2 heads, so head dim 32: mx.quantize needs groups of >= 32."""
    return build_tiny_qwen(num_attention_heads=2, num_key_value_heads=2)


@pytest.fixture(scope="session")
def tiny(models_dir: Path):
    """builtin:tiny loaded in this process: (model, tokenizer)."""
    from exokv.model.resolve import load_model

    old = os.environ.get("EXOKV_HOME")
    os.environ["EXOKV_HOME"] = str(models_dir.parent)
    try:
        return load_model("builtin:tiny")
    finally:
        if old is None:
            del os.environ["EXOKV_HOME"]
        else:
            os.environ["EXOKV_HOME"] = old


# Tests that start ranks pass fixed --starting-port values in 25000-26999, each test
# its own: below the ephemeral range (Linux 32768-60999, macOS 49152-65535), so no
# port the OS hands out for an outgoing connection can take one of them mid-suite.
@pytest.fixture(scope="session")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """builtin:tiny generated once per test session; tests' homes copy or link it."""
    home = tmp_path_factory.mktemp("models-home")
    subprocess.run(
        [sys.executable, "-c", "from exokv.model.builtin import ensure_builtin as e; e('tiny')"],
        env={**os.environ, "EXOKV_HOME": str(home)},
        check=True,
        timeout=120,
    )
    return home / "models"


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct converted for mlx-lm: fetched and converted once per machine.

    It lives in the machine's models folder (EXOKV_MODELS or the user's cache dir),
    shared by every test and session; real-model tests keep --max-tokens small.
    """
    from exokv.model.smollm2 import ensure_smollm2

    return ensure_smollm2()


@pytest.fixture(scope="session")
def gemma3_dir() -> Path:
    """Gemma 3 270M (base, Q4_K_M) converted for mlx-lm: fetched and converted once per
    machine, like smollm2_dir; a larger vocabulary and slower, so fewer tests."""
    from exokv.model.gemma3_270m import ensure_gemma3

    return ensure_gemma3()


# -- the slow marker, held by construction ------------------------------------------
# `pytest -m "not slow"` is the suite's fast half. A test that starts ranks (mlx.launch,
# `exokv chat -n 2`, any `exokv` in a subprocess), a server (`exokv serve`, uvicorn,
# mlx_lm.server), a real model (SmolLM2, Gemma 3 270M) or the ssh hosts is marked slow
# (`pytestmark = pytest.mark.slow` for a whole file). For a test that is not, starting
# any of them fails at once, saying so: the fast half cannot quietly become slow again.
# Only this process's own children are seen: a shell or a script that goes on to start
# exokv is on the test's author.

SLOW_FIXTURES = {
    "smollm2_dir": "a real model (SmolLM2)",
    "gemma3_dir": "a real model (Gemma 3 270M)",
    "ssh_hosts": "the ssh hosts (an sshd)",
    "three_hosts": "the three ssh hosts (an sshd each)",
}
_SLOW_PROGRAMS = {"exokv", "exokv-launch", "mlx.launch", "mlx_lm.server", "sshd", "uvicorn"}
_SLOW_MODULES = {"exokv", "exokv.rank.main", "mlx.launch", "mlx_lm.server", "uvicorn"}
# in `python -c CODE`: the CLI, a rank's entry (exokv.launch.command.rank_command), turns
# on a client of ours, a server. Importing modules to look at them is not among them.
_SLOW_CODE = (
    "from exokv.cli.app import main",
    "from exokv.rank.main import",
    "LocalClient(",
    "ClusterClient(",
    "mlx.launch",
    "mlx_lm.server",
)
_running: dict[str, pytest.Item] = {}  # "item": the test being set up, run or torn down


def what_it_starts(args: Any) -> str | None:
    """What a subprocess of argv `args` starts that only a slow test may (None: nothing)."""
    if isinstance(args, (str, bytes, os.PathLike)):
        try:
            argv = shlex.split(os.fsdecode(args))  # a shell command line, or one program
        except ValueError:
            argv = [os.fsdecode(args)]
    else:
        argv = [os.fsdecode(a) for a in args]
    if not argv:
        return None
    program = Path(argv[0]).name
    if program in _SLOW_PROGRAMS:
        return program
    if program == "ssh" and any("exokv" in a for a in argv[1:]):
        return "exokv over ssh"
    for flag, value in zip(argv, argv[1:], strict=False):
        if flag == "-m" and value in _SLOW_MODULES:
            return f"python -m {value}"
        if flag == "-c" and any(code in value for code in _SLOW_CODE):
            return f"python -c {value[:60]!r}"
    return None


class StartsSlowThings(AssertionError):
    pass


def _refuse(what: str) -> None:
    item = _running.get("item")
    if item is not None and item.get_closest_marker("slow") is None:
        raise StartsSlowThings(
            f"this test starts {what}: mark it slow (@pytest.mark.slow, or "
            "`pytestmark = pytest.mark.slow` for the file; tests/conftest.py says why)"
        )


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    _running["item"] = item  # before its fixtures, module- and session-scoped ones too
    if item.get_closest_marker("slow") is None:
        used = [why for name, why in SLOW_FIXTURES.items() if name in item.fixturenames]
        if used:
            _refuse(used[0])


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item: pytest.Item) -> None:
    _running["item"] = item


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_teardown(item: pytest.Item) -> None:
    _running["item"] = item


@pytest.fixture(scope="session", autouse=True)
def _slow_things_need_the_slow_marker() -> Iterator[None]:
    """For the whole session: a test without the slow marker that starts ranks, a server
    or a real model fails with StartsSlowThings (see what_it_starts)."""
    import uvicorn

    from exokv.model import gemma3_270m, smollm2, wheel_gguf  # noqa: F401 - patched below

    execute_child = subprocess.Popen._execute_child  # type: ignore[attr-defined]
    server_init = uvicorn.Server.__init__
    ensure_model = wheel_gguf.ensure_model

    def guarded_execute_child(self: subprocess.Popen, args: Any, *rest: Any, **kw: Any) -> Any:
        what = what_it_starts(args)
        if what is not None:
            _refuse(what)
        return execute_child(self, args, *rest, **kw)

    def guarded_server_init(self: Any, *args: Any, **kw: Any) -> None:
        _refuse("a uvicorn server")
        server_init(self, *args, **kw)

    def guarded_ensure_model(model: Any, *args: Any, **kw: Any) -> Any:
        _refuse(f"a real model ({getattr(model, 'title', model)})")
        return ensure_model(model, *args, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(subprocess.Popen, "_execute_child", guarded_execute_child)
        mp.setattr(uvicorn.Server, "__init__", guarded_server_init)
        # every module that imported it by name (exokv.model.smollm2, gemma3_270m, ...)
        for module in [m for name, m in sys.modules.items() if name.startswith("exokv")]:
            if getattr(module, "ensure_model", None) is ensure_model:
                mp.setattr(module, "ensure_model", guarded_ensure_model)
        yield
