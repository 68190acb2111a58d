"""The model settings every run shares: which checkpoint, in which compute dtype."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from leantrain.settings import Strict


class ModelConfig(Strict):
    name: str = Field(
        "tiny",
        description="Preset (`tiny`, `tiny-tools`, `tiny-vl`, `smollm2-135m`) or a local HF "
        "folder (a causal LM, or a VLM saved with its processor).",
    )
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description="Compute dtype (weights stay float32): `auto` is bfloat16 autocast on CUDA "
        "and float32 on CPU.",
    )
    freeze_vision: bool = Field(
        False,
        description="Vision-language models only: keep the vision tower's weights fixed during "
        "RL (the projector and the LM still train). Saves its gradients and optimizer state and "
        "keeps the image features the warm start learned; off lets RL adapt the reading too.",
    )


# Every projection of a Llama/Qwen-style decoder layer.
LLAMA_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraSettings(Strict):
    """A LoRA adapter's size (models/lora.py), for `leantrain tune` and GRPO alike."""

    r: int = Field(8, ge=1, description="LoRA rank: adapter size; higher learns more, costs more.")
    alpha: float = Field(16.0, gt=0, description="LoRA scale numerator (update x alpha / r).")
