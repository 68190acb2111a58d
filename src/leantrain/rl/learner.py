"""The learner: trajectories -> group advantages -> packed, micro-batched policy loss -> optimizer
step -> policy version v+1. It owns the optimizer, the learning-rate schedule, the step and
version counters, the non-finite skip, its checkpoints and the weights it publishes; it knows
nothing about where trajectories come from (rl/rollout.py) or how they are scheduled
(rl/orchestrator.py).

One `step` per rollout batch: `num_iterations` optimizer steps on it (each one version), at the
learning rate the schedule gives that step. A non-finite loss or gradient skips the update
(weights untouched, `skipped: 1`) instead of corrupting the weights.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from leantrain.generation.backend import weights_snapshot
from leantrain.rl.config import RLConfig
from leantrain.rl.losses import correction_inputs, group_advantages, policy_loss
from leantrain.rl.packing import PackedBatch, loss_context, micro_batches, pack, packed_logprobs
from leantrain.rl.rollout import compute_autocast
from leantrain.rl.trajectory import Trajectory
from leantrain.training.checkpoint import load_checkpoint, save_checkpoint

log = logging.getLogger(__name__)


def lr_factor(schedule: str, step: int, warmup_steps: int, total_steps: int) -> float:
    """The fraction of the peak lr used at optimizer step `step` (0-based): a linear warm-up
    over `warmup_steps`, times the schedule's decay, `LR_DECAY[schedule](step / total_steps)`."""
    warmup = min(1.0, (step + 1) / max(1, warmup_steps))
    return warmup * LR_DECAY[schedule](min(1.0, step / max(1, total_steps)))


LR_DECAY: dict[str, Callable[[float], float]] = {
    "constant": lambda progress: 1.0,
    "cosine": lambda progress: 0.5 * (1.0 + math.cos(math.pi * progress)),
}


def dropout_free(model: torch.nn.Module) -> bool:
    """Whether `model` computes the same in train and eval mode: no dropout module with p > 0
    and no attention or hidden dropout in its config."""
    config = getattr(model, "config", None)
    rates = [getattr(config, k, 0.0) or 0.0 for k in ("attention_dropout", "hidden_dropout")]
    modules = [m.p for m in model.modules() if isinstance(m, torch.nn.Dropout)]
    return not any(rate > 0 for rate in rates + modules)


class Learner:
    """GRPO's policy update on `model` (fp32 master weights; forwards under the run's autocast).

    Attributes:
        steps: learner steps taken (one per rollout batch): the run's step.
        version: the policy version, one per optimizer step.
    """

    def __init__(self, config: RLConfig, model: torch.nn.Module, device: torch.device) -> None:
        self.config = config
        self.model = model
        self.device = device
        g = config.grpo
        trainable = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(trainable, lr=g.lr, weight_decay=g.weight_decay)
        self.ref_model = None
        if g.beta > 0:
            self.ref_model = copy.deepcopy(model).eval().requires_grad_(False)
        # The engine's logprobs are log_softmax(logits / T), T = 1 when greedy; so are ours.
        temperature = config.sampling.temperature
        self.logprob_temperature = temperature if temperature > 0 else 1.0
        self.steps = 0
        self.version = 0

    def autocast(self) -> contextlib.AbstractContextManager:
        return compute_autocast(self.config, self.device)

    def step(
        self, trajectories: list[Trajectory], correction: str = "none", is_cap: float = 5.0
    ) -> dict[str, float]:
        """`num_iterations` optimizer steps on one rollout batch; returns loss stats (of the last).

        `correction` treats stale samples (`rl.losses.CORRECTIONS`); sync runs use "none".
        """
        g = self.config.grpo
        rewards = torch.tensor([t.reward for t in trajectories])
        groups = torch.tensor([t.group_id for t in trajectories])
        advantages = group_advantages(rewards, groups, scale=g.scale_rewards)
        batches = [
            pack([trajectories[i] for i in idx], advantages[idx], mask_truncated=g.mask_truncated)
            for idx in micro_batches(trajectories, g.micro_batch_tokens)
        ]
        ctx = loss_context(batches, max_completion_length=self.config.sampling.max_new_tokens)
        # A function of the step and `steps`: resumed with the same `steps`, a run follows the
        # same schedule.
        lr = g.lr * lr_factor(g.lr_schedule, self.steps, g.warmup_steps, self.config.steps)
        for param_group in self.optimizer.param_groups:
            param_group["lr"] = lr
        stats: dict[str, float] = {"skipped": 0.0, "lr": lr}
        # The decoupled correction's proximal policy is the weights before this step's update,
        # without dropout like the rollout. With one pass and no dropout, every micro-batch's
        # training forward runs on exactly those weights (the optimizer steps after the last),
        # so its detached logprobs are pi_prox; otherwise one no-grad forward each, up front.
        one_pass = g.num_iterations == 1 and dropout_free(self.model)
        loss_inputs: list[dict[str, Any] | None] = [None] * len(batches)
        if not one_pass:
            self.model.eval()
            loss_inputs = [
                self._correction_inputs(correction, mb.to(self.device), is_cap) for mb in batches
            ]
        self.model.train()
        for _ in range(g.num_iterations):
            total_loss = 0.0
            iteration_stats: dict[str, float] = {}
            for mb, extra in zip(batches, loss_inputs, strict=True):
                mb = mb.to(self.device)
                with self.autocast():
                    logp = packed_logprobs(self.model, mb, self.logprob_temperature)
                    if extra is None:
                        prox = logp.detach()
                        extra = correction_inputs(
                            correction, mb.old_logprobs, lambda p=prox: p, is_cap
                        )
                    ref = None
                    if self.ref_model is not None:
                        with torch.no_grad():
                            ref = packed_logprobs(self.ref_model, mb, self.logprob_temperature)
                loss, mb_stats = policy_loss(
                    logp,
                    advantages=mb.advantages,
                    loss_mask=mb.loss_mask,
                    sequence_index=mb.sequence_index,
                    ctx=ctx,
                    loss_type=g.loss_type,
                    epsilon=g.epsilon,
                    epsilon_high=g.epsilon_high,
                    beta=g.beta,
                    ref_logp=ref,
                    **extra,
                )
                loss.backward()
                total_loss += float(loss.detach())
                share = float(mb.loss_mask.sum()) / max(1, ctx.num_active_tokens)
                for k, v in mb_stats.items():  # token-weighted mean over micro-batches
                    iteration_stats[k] = iteration_stats.get(k, 0.0) + float(v) * share
            grad_norm = float(
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), g.max_grad_norm)
            )
            if not (math.isfinite(total_loss) and math.isfinite(grad_norm)):
                log.warning(
                    "step %d: non-finite loss (%s) or gradient norm (%s); update skipped",
                    self.steps,
                    total_loss,
                    grad_norm,
                )
                self.optimizer.zero_grad(set_to_none=True)
                stats["skipped"] = 1.0
                continue
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.version += 1  # one version per optimizer step
            stats.update(iteration_stats, loss=total_loss, grad_norm=grad_norm)
        stats["active_tokens"] = float(ctx.num_active_tokens)
        self.model.eval()
        self.steps += 1  # a skipped update is still a step of the schedule
        return stats

    def _correction_inputs(self, correction: str, mb: PackedBatch, is_cap: float) -> dict:
        """`policy_loss`'s correction arguments for `mb`, its proximal logprobs (R,) from one
        forward on the current weights where the correction needs them."""

        def proximal() -> torch.Tensor:
            with self.autocast():
                return packed_logprobs(self.model, mb, self.logprob_temperature)

        return correction_inputs(correction, mb.old_logprobs, proximal, is_cap)

    def publish(self) -> dict[str, torch.Tensor]:
        """This version's weights for the rollout backends (`weights_snapshot`)."""
        return weights_snapshot(self.model)

    def save(self, root: Path, keep: int, state: dict[str, Any]) -> Path:
        """Checkpoint weights, optimizer, RNG, the counters and the caller's `state`."""
        return save_checkpoint(
            root, self.steps, self.model, self.optimizer, {**state, "version": self.version}, keep
        )

    def load(self, path: Path) -> dict[str, Any]:
        """Resume from checkpoint `path`: weights, optimizer, RNG and counters; returns the
        state saved with it."""
        state = load_checkpoint(path, self.model, self.optimizer)
        self.steps, self.version = state["step"], state["version"]
        return state
