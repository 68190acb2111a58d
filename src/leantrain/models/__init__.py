"""Models: load any HF causal LM or VLM from a path, or a built-in preset (`PRESETS`: `tiny`,
`tiny-tools`, `tiny-vl`, `smollm2-135m`)."""

from leantrain.models.chat import encode_prompt
from leantrain.models.loading import (
    PRESETS,
    export_model,
    is_sharded_checkpoint,
    load_model,
    load_sharded_weights,
    pick_device,
    resolve_model_path,
)
from leantrain.models.presets.tiny import ensure_tiny
from leantrain.settings import leantrain_home

__all__ = [
    "PRESETS",
    "encode_prompt",
    "ensure_tiny",
    "export_model",
    "is_sharded_checkpoint",
    "leantrain_home",
    "load_model",
    "load_sharded_weights",
    "pick_device",
    "resolve_model_path",
]
