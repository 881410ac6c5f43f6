"""Pipeline ranks on a checkpoint whose hidden state changes dtype (issue 18).

A GGUF read by mx.load has a float16 quantized embedding and float32 norms: the
hidden state is float16 entering the first layer and float32 after it. A rank that
received into a buffer shaped like its own embedding output took half of what the
previous rank sent; the rest was read by the turn's next collective (the agreed
stop came out true on rank 0 alone: "stopped before the reply began", then "out of
step"). Both pipelines are covered: exokv's generic one (llama) and mlx-lm's own
(qwen2).
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest
from gguf_like import write_gguf_like
from zoo_helpers import CACHED_TURNS, replies, zoo_chat

from exokv.model.pipeline import hidden_dtypes

PORTS = {"llama": "25600", "qwen2": "25610"}


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def gguf_like(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gguf_like(tmp_path_factory.mktemp(f"gguf-like-{request.param}"), request.param)


def test_the_checkpoint_has_the_property(gguf_like: Path) -> None:
    from mlx_lm import load

    model, _ = load(str(gguf_like))
    # float16 out of the embedding, float32 from the first layer on.
    assert hidden_dtypes(model) == [mx.float16] + [mx.float32] * 4


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_two_pipeline_ranks_equal_one(gguf_like: Path, tmp_path: Path) -> None:
    family = "qwen2" if "qwen2" in gguf_like.name else "llama"
    code, one, err = zoo_chat(tmp_path / "one", str(gguf_like))
    assert code == 0, err
    port = ("--starting-port", PORTS[family])
    code, two, err = zoo_chat(tmp_path / "two", str(gguf_like), "-n", "2", *port)
    assert code == 0, err
    assert replies(two) == replies(one)
    assert len(set(replies(one))) > 1, "replies must depend on the prompt"
    assert all(t["ranks"] == 2 and t["finish_reason"] != "interrupted" for t in two)
    assert all(two[i]["cached_tokens"] > 0 for i in CACHED_TURNS)
