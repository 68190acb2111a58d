"""Off-policy corrections for stale samples: how the loss treats tokens that an older policy
version (the behaviour policy mu) sampled, when rollouts run ahead of the trainer.

Knows nothing about orchestration or versions: it turns one packed micro-batch into the extra
arguments of `rl.losses.policy_loss`. Each correction is one function, picked by name:

- `none`: the PPO ratio against mu's logprobs, exactly what synchronous GRPO does.
- `decoupled` (AReaL, arXiv 2505.24298): clip around the proximal policy pi_prox (the trainer's
  weights before this step, one no-grad forward) and weight each token by min(pi_prox / mu, cap),
  so the trust region is centred on the current policy however stale mu is.
- `tis`: truncated importance sampling (prime-rl's AIPO): -min(pi_theta / mu, cap) * A, no clip,
  no extra forward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from leantrain.rl.packing import PackedBatch

# (micro-batch, proximal-logprob function, cap) -> keyword arguments of `policy_loss`.
Correction = Callable[[PackedBatch, Callable[[PackedBatch], Tensor], float], dict[str, Any]]


def no_correction(
    mb: PackedBatch, proximal: Callable[[PackedBatch], Tensor], cap: float
) -> dict[str, Any]:
    """Ratio against the behaviour logprobs, as in sync GRPO."""
    return {"old_logp": mb.old_logprobs}


def decoupled_ppo(
    mb: PackedBatch, proximal: Callable[[PackedBatch], Tensor], cap: float
) -> dict[str, Any]:
    """Clip around pi_prox, importance weight min(pi_prox / mu, cap) per token (both (R,))."""
    with torch.no_grad():
        prox = proximal(mb).float()  # (R,) log pi_prox, the weights before this step
    weight = torch.exp(prox - mb.old_logprobs).clamp(max=cap)  # (R,)
    return {"old_logp": prox, "is_weight": weight}


def truncated_is(
    mb: PackedBatch, proximal: Callable[[PackedBatch], Tensor], cap: float
) -> dict[str, Any]:
    """-min(pi_theta / mu, cap) * A against the behaviour logprobs (no extra forward)."""
    return {"old_logp": mb.old_logprobs, "tis_cap": cap}


CORRECTIONS: dict[str, Correction] = {
    "none": no_correction,
    "decoupled": decoupled_ppo,
    "tis": truncated_is,
}


def correction_inputs(
    name: str, mb: PackedBatch, proximal: Callable[[PackedBatch], Tensor], cap: float
) -> dict[str, Any]:
    """`policy_loss` keyword arguments for micro-batch `mb` under correction `name`.

    Call it for every micro-batch BEFORE the first optimizer step of a batch: `proximal` must
    see the weights the batch is trained from, not weights it already moved.
    """
    if name not in CORRECTIONS:
        raise ValueError(
            f"off-policy correction must be one of {sorted(CORRECTIONS)}, got {name!r}"
        )
    return CORRECTIONS[name](mb, proximal, cap)
