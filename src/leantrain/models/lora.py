"""LoRA adapters through peft, injected in place: the Hugging Face model object stays the one
that is trained, sampled from and checkpointed (its targeted linears become peft `LoraLayer`s
with a frozen `base_layer` and trainable `lora_A` / `lora_B`). What an adapter is in a state
dict, and how to split one back into the base weights and the adapter. Knows nothing about
training loops or inference engines.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from leantrain.errors import LeantrainError
from leantrain.models.config import LoraSettings

if TYPE_CHECKING:  # peft is imported where an adapter is made, not with this module
    from peft import LoraConfig


def lora_config(settings: LoraSettings, targets: Sequence[str]) -> LoraConfig:
    """peft's config of an adapter of `settings` on the linears whose names end in `targets`."""
    from peft import LoraConfig

    return LoraConfig(r=settings.r, lora_alpha=settings.alpha, target_modules=list(targets))


def inject_lora(
    model: torch.nn.Module, settings: LoraSettings, targets: Sequence[str], field: str = "targets"
) -> LoraConfig:
    """Freeze `model` and add a trainable LoRA adapter (peft's `default`) to its `targets`, in
    place; returns the adapter's peft config. `field` names the setting in an error."""
    from peft import inject_adapter_in_model

    config = lora_config(settings, targets)
    model.requires_grad_(False)
    try:
        inject_adapter_in_model(config, model)
    except ValueError as e:
        raise LeantrainError(f"{field}: {e}") from None
    return config


def is_adapter_weight(name: str) -> bool:
    """Whether a state-dict entry of an injected model is an adapter's (`lora_A` / `lora_B`)."""
    return ".lora_A." in name or ".lora_B." in name


def split_adapter(
    state: Mapping[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """An injected model's state dict as (the base model's, under its own names, as in the
    checkpoint it came from; the adapter's, under the names peft's `save_pretrained` writes:
    `base_model.model.<module>.lora_A.weight`, which vLLM and `PeftModel` load)."""
    base: dict[str, torch.Tensor] = {}
    adapter: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if is_adapter_weight(name):
            adapter["base_model.model." + name.replace(".default.", ".")] = tensor
        else:
            base[name.replace(".base_layer.", ".")] = tensor
    return base, adapter
