"""LoRA through peft, and many LoRA states scored in one forward.

`add_lora` wraps a model with peft LoRA (base frozen, adapters trainable, as MeZO's LoRA mode).
`stacked_adapters` makes one forward over S groups of rows run each group under its own copy of
the adapter weights: every LoRA factor is given a stack (S, out, in) and its `nn.Linear` computes
a batched matmul, group g of the rows against stack g. The frozen base runs once over all S x b
rows. That is how a batch of perturbed adapter states (ZO directions) costs one forward.

What it does NOT know about: perturbations and seeds (the stacks are whatever the caller fills).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Sequence

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora import LoraLayer
from transformers import PreTrainedModel

from leantrain.errors import LeantrainError

ADAPTER = "default"


def add_lora(model: PreTrainedModel, r: int, alpha: int, targets: Sequence[str]) -> PeftModel:
    """`model` with LoRA factors (rank r, scaling alpha / r, no dropout) on the `targets` modules;
    only the factors require grad. B starts at zero, so the wrapped model computes what `model`
    did."""
    names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    missing = sorted(set(targets) - names)
    if missing:
        raise LeantrainError(
            f"zo.lora_targets {missing} name no module of this model "
            f"(e.g. q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj)"
        )
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0)
    with warnings.catch_warnings():  # peft calls a deprecated transformers property
        warnings.simplefilter("ignore", FutureWarning)
        return get_peft_model(model, config)


def lora_factors(model: torch.nn.Module) -> list[torch.nn.Linear]:
    """The LoRA A and B `nn.Linear`s of every adapted layer, in `named_parameters` order."""
    factors = []
    for module in model.modules():
        if isinstance(module, LoraLayer) and ADAPTER in module.lora_A:
            factors += [module.lora_A[ADAPTER], module.lora_B[ADAPTER]]
    return factors


@contextlib.contextmanager
def stacked_adapters(
    factors: Sequence[torch.nn.Linear], stacks: Sequence[torch.Tensor]
) -> Iterator[None]:
    """While active, factor i computes group g of its input rows with `stacks[i][g]`.

    Args:
        factors: LoRA factor linears (from `lora_factors`).
        stacks: one (S, out, in) tensor per factor; the forward's batch must be S equal groups of
            rows, group g contiguous (rows g*b .. g*b + b - 1).
    """
    if len(factors) != len(stacks):
        raise LeantrainError(f"{len(stacks)} stacks for {len(factors)} LoRA factors")

    def grouped(stack: torch.Tensor):
        def forward(x: torch.Tensor) -> torch.Tensor:  # x (S*b, T, in) -> (S*b, T, out)
            groups = stack.shape[0]
            rows = x.reshape(groups, -1, x.shape[-1])  # (S, b*T, in)
            out = torch.bmm(rows, stack.transpose(1, 2))  # (S, b*T, out)
            return out.reshape(*x.shape[:-1], stack.shape[1])

        return forward

    for factor, stack in zip(factors, stacks, strict=True):
        factor.forward = grouped(stack)  # an instance attribute shadows nn.Linear.forward
    try:
        yield
    finally:
        for factor in factors:
            del factor.forward
