"""Models: the synthetic builtins and resolving any --model value to mlx-lm."""

from exokv.model.catalogue import list_models
from exokv.model.resolve import BUILTIN_NAMES, load_model, model_id, resolve_model

__all__ = ["BUILTIN_NAMES", "list_models", "load_model", "model_id", "resolve_model"]
