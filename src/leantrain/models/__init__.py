"""Models: load any HF causal LM from a path, or a built-in preset (`tiny`, `smollm2-135m`)."""

from leantrain.models.chat import encode_prompt
from leantrain.models.loading import PRESETS, load_model, pick_device, resolve_model_path
from leantrain.models.tiny import ensure_tiny, leantrain_home

__all__ = [
    "PRESETS",
    "encode_prompt",
    "ensure_tiny",
    "leantrain_home",
    "load_model",
    "pick_device",
    "resolve_model_path",
]
