"""Shared fixtures for the test suite."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models import qwen2
from ssh_hosts import ssh_hosts  # noqa: F401 - the two ssh hosts, for any test module

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
