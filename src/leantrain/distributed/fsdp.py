"""FSDP2 (`torch.distributed.fsdp.fully_shard`) for a Hugging Face model: every decoder layer is
its own unit, then the root (embeddings, final norm, LM head, tied or not), so one layer's full
weights exist at a time in forward and backward. Also the full state dict that rank 0 publishes
and checkpoints, and the balanced split that hands each rank its share of a step's work.

Knows nothing about losses or trajectories: a model in, the same model sharded in place out.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from leantrain.errors import LeantrainError


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The modules FSDP shards one by one: those whose class the model lists in
    `_no_split_modules` (transformers' own answer to "what must stay whole": the decoder layers,
    a VLM's vision blocks)."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise LeantrainError(
            f"cannot shard {type(model).__name__} with FSDP: it names no decoder layer class in "
            "`_no_split_modules` (a Hugging Face causal LM or VLM does)"
        )
    return layers


def shard(model: nn.Module, param_dtype: torch.dtype | None = None) -> nn.Module:
    """Shard `model` over the default process group (in place; returns it).

    `param_dtype` (bf16 on GPUs) is the FSDP mixed-precision policy: weights all-gathered and
    computed in that dtype, gradients reduced in fp32, master weights stay fp32; None computes in
    the weights' dtype (CPU runs, fp32 end to end).

    Gradients are SUMMED over ranks, not averaged: every rank's loss is already its exact share
    of the whole step's loss (`rl.losses`), so the sum is the single-process gradient.
    """
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    if param_dtype is None:
        policy = MixedPrecisionPolicy()
    for layer in decoder_layers(model):
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            # A plain SUM collective (gloo has no pre-multiplied sum), then a division by 1.
            module.set_force_sum_reduction_for_comms(True)
    return model


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """A collective (every rank calls it): the sharded `model`'s full weights, on rank 0's CPU;
    other ranks get an empty dict. Gathered one tensor at a time, so no rank ever holds more than
    its shard plus one full tensor on the accelerator."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options)


def balanced_split(sizes: list[int], parts: int) -> list[list[int]]:
    """Deal items of the given sizes to `parts` bins so the bins' totals are as even as a greedy
    can make them, while their counts differ by at most one (ceil(n / parts) per bin at most).

    Largest first, each to the lightest bin with room (ties: the lower item index, the lower
    bin), so every rank computes the same split from the same sizes. Returns each bin's item
    indices in ascending order; every index appears exactly once.
    """
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    capacity = -(-len(sizes) // parts)  # ceil
    bins: list[list[int]] = [[] for _ in range(parts)]
    totals = [0] * parts
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        b = min((b for b in range(parts) if len(bins[b]) < capacity), key=lambda b: totals[b])
        bins[b].append(i)
        totals[b] += sizes[i]
    return [sorted(b) for b in bins]
