"""Group-relative advantages (GRPO): each response's reward compared with the other responses to
the same prompt. Knows nothing about tokens, losses or models: rewards in, one advantage per
trajectory out; the packer broadcasts it over the response tokens."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
from torch import Tensor

AdvantageScale = Literal["group", "batch", "none"]


def group_advantages(
    rewards: Tensor,  # (N,) total reward of each trajectory
    group_ids: Tensor,  # (N,) int, trajectories with equal ids answer the same prompt
    scale: AdvantageScale = "group",
    eps: float = 1e-4,
) -> Tensor:  # (N,)
    """Mean-centred rewards per group, optionally divided by a standard deviation.

        A_i = (r_i - mean_{g(i)}(r)) / (std + eps)

    where std is, by `scale`:

    * "group": the std of the rewards in i's group (GRPO, TRL `scale_rewards="group"`);
    * "batch": the std of all N rewards (TRL `scale_rewards="batch"`);
    * "none":  no division and no eps, A_i = r_i - mean_{g(i)}(r) (Dr. GRPO: dividing by the
      group std up-weights prompts that are almost always or almost never solved).

    The std is the unbiased one (Bessel-corrected, divide by n - 1), as `torch.std` and TRL's
    `nanstd` compute it, and `eps` (> 0) is added to the std, not the variance, as in TRL.
    A group of one has nothing to be compared with, so its advantage is 0 under every scale.
    Groups need not be contiguous nor of equal size.

    Returns:
        advantages, (N,), in the floating dtype of `rewards` (float32 for integer rewards).
    """
    if rewards.dim() != 1 or rewards.shape != group_ids.shape:
        raise ValueError(
            f"rewards and group_ids must both have shape (N,), got {tuple(rewards.shape)} "
            f"and {tuple(group_ids.shape)}"
        )
    if scale not in ("none", *_STD):
        raise ValueError(f"scale must be 'group', 'batch' or 'none', got {scale!r}")
    if eps <= 0:
        raise ValueError(f"eps must be > 0 (it keeps equal-reward groups at 0, not NaN), got {eps}")
    if not rewards.is_floating_point():
        rewards = rewards.float()
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    counts = counts.to(rewards.dtype)
    centred = rewards - _group_sum(rewards, inverse, counts)[inverse] / counts[inverse]
    if scale == "none":
        return centred
    return centred / (_STD[scale](rewards, centred, inverse, counts) + eps)


def _group_sum(
    values: Tensor,  # (N,)
    inverse: Tensor,  # (N,) dense group index 0..G-1 of each value
    counts: Tensor,  # (G,) group sizes, only for the output's size and dtype
) -> Tensor:  # (G,)
    return torch.zeros_like(counts).index_add_(0, inverse, values)


# Each std function: (rewards (N,), centred (N,), inverse (N,), counts (G,)) -> std, broadcastable
# to (N,). Where the std is undefined (fewer than two rewards) it is 0: the centred reward is 0
# there too, so the advantage comes out 0 rather than NaN.
StdFn = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


def _group_std(rewards: Tensor, centred: Tensor, inverse: Tensor, counts: Tensor) -> Tensor:
    """Per-group unbiased std, sqrt(sum_group (r - mean)^2 / (n - 1)), gathered back to (N,)."""
    variance = _group_sum(centred.square(), inverse, counts) / (counts - 1).clamp(min=1)
    return variance.sqrt()[inverse]


def _batch_std(rewards: Tensor, centred: Tensor, inverse: Tensor, counts: Tensor) -> Tensor:
    """Unbiased std of all N raw rewards (around the batch mean, not the group means)."""
    return rewards.std() if rewards.numel() > 1 else rewards.new_zeros(())


_STD: dict[str, StdFn] = {"group": _group_std, "batch": _batch_std}
