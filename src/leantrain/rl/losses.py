"""GRPO's arithmetic on flat tensors: group advantages, the policy losses with their
normalisations, and the off-policy corrections for stale samples.

Knows nothing about models, packing or trajectories: rewards in, one advantage per trajectory
out; per-token log-probabilities, advantages and a loss mask in, a scalar loss out.

Policy losses, written so gradient accumulation is exact. Every loss variant is a per-token
weight w_t, and the loss of the whole optimizer-step batch B is

    L = sum_{t in B} w_t * l_t,    l_t = clipped policy loss (+ beta * k3 KL) of token t.

The weights are built from a micro-batch's own tokens plus the global counts in `LossContext`, so
each micro-batch's loss is its share of L: call `backward()` on every micro-batch's loss as it is
(do not divide by the number of micro-batches) and the accumulated gradient is that of L, whatever
the split. The variants and their normalizations follow TRL `GRPOTrainer._compute_loss`.

Off-policy corrections: how the loss treats tokens that an older policy version (the behaviour
policy mu) sampled, when rollouts run ahead of the trainer. Each is one function, picked by name,
that turns a micro-batch's behaviour logprobs into the extra arguments of `policy_loss`:

- `none`: the PPO ratio against mu's logprobs, exactly what synchronous GRPO does.
- `decoupled` (AReaL, arXiv 2505.24298): clip around the proximal policy pi_prox (the trainer's
  weights before this step, one no-grad forward) and weight each token by min(pi_prox / mu, cap),
  so the trust region is centred on the current policy however stale mu is.
- `tis`: truncated importance sampling (prime-rl's AIPO): -min(pi_theta / mu, cap) * A, no clip,
  no extra forward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

# ----------------------------------------------------------- advantages
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


# --------------------------------------------------------- policy losses
@dataclass(frozen=True)
class LossContext:
    """Counts over the whole optimizer-step batch (every micro-batch) that the weights divide by.

    Attributes:
        num_sequences: trajectories in the whole batch, fully masked ones included (TRL counts
            them too), N in the formulas.
        num_active_tokens: sum of the loss mask over the whole batch (dapo's denominator).
        max_completion_length: dr_grpo's constant L, the generation budget in tokens.
        num_micro_batches: micro-batches in the step; only bnpo uses it.
    """

    num_sequences: int
    num_active_tokens: int
    max_completion_length: int | None = None
    num_micro_batches: int = 1

    def __post_init__(self) -> None:
        if self.num_sequences < 1:
            raise ValueError(f"LossContext.num_sequences must be >= 1, got {self.num_sequences}")
        if self.num_micro_batches < 1:
            raise ValueError(
                f"LossContext.num_micro_batches must be >= 1, got {self.num_micro_batches}"
            )


def per_token_policy_loss(
    logp: Tensor,  # (T,) log pi_theta(token), with grad
    old_logp: Tensor,  # (T,) log pi_old(token), the policy that sampled it (no grad)
    advantages: Tensor,  # (T,) advantage of each token's sequence
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO-clipped surrogate per token (GRPO / DAPO "clip-higher").

        r_t = exp(logp_t - old_logp_t)
        l_t = -min(r_t * A_t, clip(r_t, 1 - epsilon, 1 + epsilon_high) * A_t)

    `epsilon_high` defaults to `epsilon` (symmetric clip, TRL semantics); DAPO suggests 0.28.

    Returns:
        loss: (T,) unreduced and unmasked.
        stats: per-token, detached: "ratio" (T,) r_t; "clipped_low" / "clipped_high" (T,) bool,
            where the clip is active, i.e. r_t left the trust region in the direction the
            advantage pushes it (r < 1 - eps with A < 0, r > 1 + eps_high with A > 0), which
            are exactly the tokens whose gradient the clip zeroes.
    """
    epsilon_high = epsilon if epsilon_high is None else epsilon_high
    ratio = torch.exp(logp - old_logp)
    clipped_ratio = ratio.clamp(1 - epsilon, 1 + epsilon_high)
    loss = -torch.min(ratio * advantages, clipped_ratio * advantages)
    ratio = ratio.detach()
    stats = {
        "ratio": ratio,
        "clipped_low": (ratio < 1 - epsilon) & (advantages < 0),
        "clipped_high": (ratio > 1 + epsilon_high) & (advantages > 0),
    }
    return loss, stats


def truncated_is_loss(
    logp: Tensor,  # (T,) log pi_theta(token), with grad
    behaviour_logp: Tensor,  # (T,) log mu(token), the (possibly stale) policy that sampled it
    advantages: Tensor,  # (T,) advantage of each token's sequence
    cap: float,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Truncated importance sampling (prime-rl's AIPO), the cheap off-policy correction:

        r_t = exp(logp_t - behaviour_logp_t)
        l_t = -min(r_t, cap) * A_t

    No trust-region clip and no extra forward: the gradient r_t * A_t * grad(logp_t) flows
    where r_t < cap and is cut where the stale sample is too unlikely under mu to trust.

    Returns the (T,) loss and the same per-token stats as `per_token_policy_loss`
    ("clipped_high": tokens whose weight hit the cap; nothing is clipped below).
    """
    ratio = torch.exp(logp - behaviour_logp)
    loss = -ratio.clamp(max=cap) * advantages
    ratio = ratio.detach()
    stats = {
        "ratio": ratio,
        "clipped_low": torch.zeros_like(ratio, dtype=torch.bool),
        "clipped_high": ratio > cap,
    }
    return loss, stats


def k3_kl(
    logp: Tensor,  # (T,) log pi_theta(token), with grad
    ref_logp: Tensor,  # (T,) log pi_ref(token) of the frozen reference policy
) -> Tensor:  # (T,)
    """Schulman's k3 estimator of KL(pi_theta || pi_ref) per token, always >= 0:

    k3_t = exp(ref_logp_t - logp_t) - (ref_logp_t - logp_t) - 1
    """
    delta = ref_logp - logp
    return torch.exp(delta) - delta - 1


# A weight function: (loss_mask (T,), sequence_index (T,), ctx) -> w (T,). loss_mask is 1 for
# trained tokens and 0 otherwise; sequence_index says which sequence of the micro-batch each token
# belongs to (a sequence never spans two micro-batches).
WeightFn = Callable[[Tensor, Tensor, LossContext], Tensor]


def grpo_weights(loss_mask: Tensor, sequence_index: Tensor, ctx: LossContext) -> Tensor:
    """Mean over each sequence's tokens, then mean over the N sequences of the whole batch:

        w_t = m_t / (|o_i| * N),  |o_i| = active tokens of t's sequence i (at least 1)

    TRL: ((l * m).sum(-1) / m.sum(-1).clamp(min=1)).mean() / grad_accum_steps, equal to this when
    every micro-batch holds N / grad_accum_steps sequences; here it is exact for any split.
    Long responses get less weight per token (the length bias Dr. GRPO and DAPO remove).
    """
    active_per_sequence = torch.bincount(sequence_index, weights=loss_mask)
    return loss_mask / (active_per_sequence[sequence_index].clamp(min=1) * ctx.num_sequences)


def dr_grpo_weights(loss_mask: Tensor, sequence_index: Tensor, ctx: LossContext) -> Tensor:
    """Sum over all tokens divided by a constant, so no length bias (Dr. GRPO):

        w_t = m_t / (N * L),  L = ctx.max_completion_length

    TRL: (l * m).sum() / (B * max_completion_length) / grad_accum_steps.
    """
    if ctx.max_completion_length is None:
        raise ValueError("loss_type 'dr_grpo' needs LossContext.max_completion_length, got None")
    return loss_mask / (ctx.num_sequences * ctx.max_completion_length)


def dapo_weights(loss_mask: Tensor, sequence_index: Tensor, ctx: LossContext) -> Tensor:
    """Token-level mean over every active token of the whole batch (DAPO; TRL's default):

        w_t = m_t / sum_{s in B} m_s

    TRL: (l * m).sum() / num_items_in_batch, the active tokens of the accumulated batch.
    """
    return loss_mask / max(ctx.num_active_tokens, 1)


def bnpo_weights(loss_mask: Tensor, sequence_index: Tensor, ctx: LossContext) -> Tensor:
    """Token mean over this micro-batch's active tokens only, then mean over micro-batches:

        w_t = m_t / (sum_{s in micro-batch} m_s * num_micro_batches)

    TRL: (l * m).sum() / m.sum().clamp(min=1) / grad_accum_steps. The only variant that does NOT
    accumulate exactly: the result depends on how the batch is split into micro-batches. It equals
    dapo when every micro-batch holds the same number of active tokens.
    """
    return loss_mask / (loss_mask.sum().clamp(min=1) * ctx.num_micro_batches)


LOSS_WEIGHTS: dict[str, WeightFn] = {
    "grpo": grpo_weights,
    "dr_grpo": dr_grpo_weights,
    "dapo": dapo_weights,
    "bnpo": bnpo_weights,
}


def policy_loss(
    logp: Tensor,  # (T,) log pi_theta of each response token of the micro-batch, with grad
    old_logp: Tensor,  # (T,) log pi_old of the same tokens (behaviour log-probabilities)
    advantages: Tensor,  # (T,) advantage of each token's sequence
    loss_mask: Tensor,  # (T,) float, 1 = trained on, 0 = ignored (tool/env or masked tokens)
    sequence_index: Tensor,  # (T,) int, index of each token's sequence within the micro-batch
    ctx: LossContext,
    loss_type: str = "dapo",
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    beta: float = 0.0,
    ref_logp: Tensor | None = None,  # (T,) log pi_ref, required when beta != 0
    is_weight: Tensor | None = None,  # (T,) no grad, importance weight of each token's l_t
    tis_cap: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """This micro-batch's share of the batch loss, sum_t w_t * (c_t * l_t + beta * k3_t).

    `loss_type` picks the weights w_t from `LOSS_WEIGHTS` (see each function for its formula).
    Off-policy corrections (stale samples from asynchronous rollouts, see rl/orchestrator.py):
    `is_weight` is c_t (decoupled PPO: old_logp is then the proximal policy and c_t the capped
    pi_prox / mu); `tis_cap` replaces the clipped surrogate by `truncated_is_loss`.

    Returns:
        loss: scalar; call `backward()` on it as it is for exact gradient accumulation.
        stats: detached scalars, means over this micro-batch's active tokens: "clip_fraction",
            "clip_low_fraction", "clip_high_fraction", "ratio_mean", "kl_mean" (beta != 0 only),
            and "active_tokens" to weight them when averaging over micro-batches.
    """
    if loss_type not in LOSS_WEIGHTS:
        raise ValueError(f"loss_type must be one of {sorted(LOSS_WEIGHTS)}, got {loss_type!r}")
    active = loss_mask > 0
    # Masked tokens (tool output, truncated responses) may carry meaningless old/ref logprobs; an
    # overflowing exp there would turn the zero-weighted loss, and every gradient, into NaN.
    old_logp = torch.where(active, old_logp, logp.detach())
    if tis_cap is None:
        per_token, token_stats = per_token_policy_loss(
            logp, old_logp, advantages, epsilon, epsilon_high
        )
    else:
        per_token, token_stats = truncated_is_loss(logp, old_logp, advantages, tis_cap)
    if is_weight is not None:
        per_token = per_token * torch.where(active, is_weight.detach(), 1.0)
    token_values = {  # per token, reduced to means over the active tokens below
        "clip_fraction": token_stats["clipped_low"] | token_stats["clipped_high"],
        "clip_low_fraction": token_stats["clipped_low"],
        "clip_high_fraction": token_stats["clipped_high"],
        "ratio_mean": token_stats["ratio"],
    }
    if beta != 0.0:
        if ref_logp is None:
            raise ValueError(f"beta={beta} needs ref_logp (reference-policy logprobs), got None")
        kl = k3_kl(logp, torch.where(active, ref_logp, logp.detach()))
        per_token = per_token + beta * kl
        token_values["kl_mean"] = kl.detach()
    weights = LOSS_WEIGHTS[loss_type](loss_mask, sequence_index, ctx)
    loss = (weights * per_token).sum()
    n_active = loss_mask.sum().detach()
    stats = {name: _masked_mean(v, loss_mask, n_active) for name, v in token_values.items()}
    stats["active_tokens"] = n_active
    return loss, stats


def _masked_mean(values: Tensor, loss_mask: Tensor, n_active: Tensor) -> Tensor:
    """Mean of `values` (T,) over the active tokens; 0 when there are none."""
    return (values * loss_mask).sum() / n_active.clamp(min=1)


# ---------------------------------------------------- off-policy corrections
# (behaviour logprobs (T,), proximal-logprob function () -> (T,), cap) -> keyword arguments of
# `policy_loss`. The proximal function runs a forward, so only corrections that need it call it.
Correction = Callable[[Tensor, Callable[[], Tensor], float], dict[str, Any]]


def no_correction(behaviour_logp: Tensor, proximal: Callable[[], Tensor], cap: float) -> dict:
    """Ratio against the behaviour logprobs, as in sync GRPO."""
    return {"old_logp": behaviour_logp}


def decoupled_ppo(behaviour_logp: Tensor, proximal: Callable[[], Tensor], cap: float) -> dict:
    """Clip around pi_prox, importance weight min(pi_prox / mu, cap) per token (both (T,))."""
    with torch.no_grad():
        prox = proximal().float()  # (T,) log pi_prox, the weights before this step
    weight = torch.exp(prox - behaviour_logp).clamp(max=cap)  # (T,)
    return {"old_logp": prox, "is_weight": weight}


def truncated_is(behaviour_logp: Tensor, proximal: Callable[[], Tensor], cap: float) -> dict:
    """-min(pi_theta / mu, cap) * A against the behaviour logprobs (no extra forward)."""
    return {"old_logp": behaviour_logp, "tis_cap": cap}


CORRECTIONS: dict[str, Correction] = {
    "none": no_correction,
    "decoupled": decoupled_ppo,
    "tis": truncated_is,
}


def correction_inputs(
    name: str, behaviour_logp: Tensor, proximal: Callable[[], Tensor], cap: float
) -> dict[str, Any]:
    """`policy_loss` keyword arguments for a micro-batch under correction `name`, from its
    behaviour logprobs (T,) and a function giving its proximal logprobs (T,).

    Call it for every micro-batch BEFORE the first optimizer step of a batch: `proximal` must
    see the weights the batch is trained from, not weights it already moved.
    """
    if name not in CORRECTIONS:
        raise ValueError(
            f"off-policy correction must be one of {sorted(CORRECTIONS)}, got {name!r}"
        )
    return CORRECTIONS[name](behaviour_logp, proximal, cap)
