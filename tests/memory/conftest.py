"""Fixtures shared by the memory tests: a factory of randomly initialised two-layer decoders."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
)

FAMILIES = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}


@pytest.fixture(scope="session")
def tiny_decoder() -> Callable[..., PreTrainedModel]:
    """`tiny_decoder(family="llama", intermediate=64, kv_heads=4)`: a seeded 2-layer model with
    hidden size 32, 4 attention heads and a 64-token vocabulary."""

    def build(family: str = "llama", intermediate: int = 64, kv_heads: int = 4) -> PreTrainedModel:
        config_cls, model_cls = FAMILIES[family]
        torch.manual_seed(0)
        config = config_cls(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=intermediate,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=kv_heads,
        )
        return model_cls(config)

    return build
