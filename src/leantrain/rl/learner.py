"""The learner: trajectories -> group advantages -> packed, micro-batched policy loss -> optimizer
step -> policy version v+1. It owns the optimizer, the learning-rate schedule, the step and
version counters, the non-finite skip, its checkpoints and the weights it publishes; it knows
nothing about where trajectories come from (rl/rollout.py) or how they are scheduled
(rl/orchestrator.py).

One `step` per rollout batch: `num_iterations` optimizer steps on it (each one version), at the
learning rate the schedule gives that step. A non-finite loss or gradient skips the update
(weights untouched, `skipped: 1`) instead of corrupting the weights.

Data-parallel over N ranks (`World.size > 1`, launched by torchrun): rank 0 hands the step's
trajectories to every rank (one broadcast), every rank packs the same micro-batches and computes
the same whole-step `LossContext` (so every loss type divides by global counts with no further
communication), and the micro-batches are dealt to the ranks balanced by tokens
(`distributed.balanced_split`). A micro-batch is the unit of sharding, so each one, and each
one's loss, is exactly the single-process one (bnpo's mean over micro-batches included); ranks
dealt one fewer run a fully masked copy of the smallest (zero loss, zero gradient) so every rank
runs the same number of FSDP forwards and backwards. FSDP sums the ranks' gradients, and the
sum is the single-process gradient. Rank 0 keeps an unsharded copy of the weights (`policy`):
what rollouts sample from and what `publish` returns. Checkpoints are written shard by shard,
every rank its own (`training.checkpoint`), never gathered.

Sequence-parallel inside that (`distributed.sequence_parallel_size` P > 1): the ranks form
world/P groups of P consecutive ranks; micro-batches are dealt to the groups, not the ranks, and
the P ranks of a group split each of its micro-batches' row between them, with Ulysses
all-to-alls around every attention (`rl.packing.sequence_parallel_logprobs`). Every rank of a
group ends up with the micro-batch's whole per-token log-probabilities, gradient flowing only
into its own tokens, and computes the micro-batch's exact loss; so the sum of all ranks'
gradients (FSDP over the whole world, as without SP) is still the single-process gradient.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from leantrain.distributed import (
    World,
    balanced_split,
    broadcast,
    check_model,
    collective,
    full_state_dict,
    register,
    sequence_group,
    shard,
    single,
)
from leantrain.generation.backend import weights_snapshot
from leantrain.rl.config import RLConfig
from leantrain.rl.losses import correction_inputs, group_advantages, policy_loss
from leantrain.rl.packing import PackedBatch, loss_context, micro_batches, pack, packed_logprobs
from leantrain.rl.rollout import compute_autocast
from leantrain.rl.trajectory import Trajectory
from leantrain.training.checkpoint import (
    load_checkpoint,
    save_checkpoint,
    save_sharded_checkpoint,
)

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
        world: this process's rank and the number of ranks (one: no process group).
        model: the module trained: `model` itself in one process, FSDP-sharded over the ranks.
        policy: the unsharded weights rollouts sample from and `publish` returns: `model` itself
            in one process; on N ranks a full copy kept on rank 0 (None on the others).
        sequence_group: the ranks that split this rank's micro-batches with it (None: no
            sequence parallelism).
    """

    def __init__(
        self,
        config: RLConfig,
        model: torch.nn.Module,
        device: torch.device,
        world: World | None = None,
    ) -> None:
        self.config = config
        self.device = device
        self.world = world or single(device)
        g = config.grpo
        self.sequence_group = self._setup_sequence_parallel(model)
        self.policy: torch.nn.Module | None = model
        self.ref_model = None
        if self.world.size > 1:
            # Rank 0 trains a copy and keeps `model` whole for rollouts; the others shard it.
            self.policy = model if self.world.is_main else None
            model = copy.deepcopy(model) if self.world.is_main else model
        if self.sequence_group is not None:  # the trained copy only: rollouts attend as before
            model.set_attn_implementation(register(self.sequence_group))
        if g.beta > 0:
            self.ref_model = copy.deepcopy(model).eval().requires_grad_(False)
        if self.world.size > 1:
            # FSDP's mixed precision on GPUs (bf16 compute, fp32 reduce and master weights).
            bf16 = device.type == "cuda" and config.model.dtype != "float32"
            with collective(self.world, "sharding the model (FSDP2)"):
                for module in filter(None, (model, self.ref_model)):
                    shard(module, torch.bfloat16 if bf16 else None)
        self.model = model
        # After sharding: the optimizer holds this rank's shards (DTensors) of the weights.
        trainable = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(trainable, lr=g.lr, weight_decay=g.weight_decay)
        # The engine's logprobs are log_softmax(logits / T), T = 1 when greedy; so are ours.
        temperature = config.sampling.temperature
        self.logprob_temperature = temperature if temperature > 0 else 1.0
        self.steps = 0
        self.version = 0

    def _setup_sequence_parallel(self, model: torch.nn.Module) -> dist.ProcessGroup | None:
        """This rank's sequence-parallel group (None when `sequence_parallel_size` is 1), after
        refusing a size that does not divide the ranks or the model's attention heads (on every
        rank, before any collective)."""
        size = self.config.distributed.sequence_parallel_size
        if size == 1:
            return None
        setting = "distributed.sequence_parallel_size"
        check_model(model, size, setting)
        with self._collective("creating the sequence-parallel groups"):
            return sequence_group(self.world, size, setting)

    def autocast(self) -> contextlib.AbstractContextManager:
        return compute_autocast(self.config, self.device)

    def _collective(self, what: str) -> contextlib.AbstractContextManager:
        """A dead or stalled peer raises a named `RankError` inside (nothing to fear alone)."""
        if self.world.size == 1:
            return contextlib.nullcontext()
        return collective(self.world, what)

    def step(
        self,
        trajectories: list[Trajectory] | None,
        correction: str = "none",
        is_cap: float = 5.0,
    ) -> dict[str, float]:
        """`num_iterations` optimizer steps on one rollout batch; returns loss stats (of the last).

        `correction` treats stale samples (`rl.losses.CORRECTIONS`); sync runs use "none". On N
        ranks every rank calls this together: rank 0 with the batch and its correction, the
        others with None (they receive rank 0's); every rank returns the same stats.
        """
        with self._collective(f"learner step {self.steps + 1}"):
            if self.world.size > 1:
                trajectories, correction, is_cap = broadcast(
                    self.world, (trajectories, correction, is_cap)
                )
            if trajectories is None:
                raise ValueError("Learner.step needs the step's trajectories (on rank 0)")
            stats = self._step(trajectories, correction, is_cap)
            if self.world.size > 1:
                self._sync_policy()
        return stats

    def _sync_policy(self) -> None:
        """Rank 0's unsharded copy takes the sharded weights (a collective: every rank calls)."""
        full = full_state_dict(self.model)
        if self.policy is not None:
            self.policy.load_state_dict(full)

    def _step(
        self, trajectories: list[Trajectory], correction: str, is_cap: float
    ) -> dict[str, float]:
        g = self.config.grpo
        rewards = torch.tensor([t.reward for t in trajectories])
        groups = torch.tensor([t.group_id for t in trajectories])
        advantages = group_advantages(rewards, groups, scale=g.scale_rewards)
        batches = [
            pack([trajectories[i] for i in idx], advantages[idx], mask_truncated=g.mask_truncated)
            for idx in micro_batches(trajectories, g.micro_batch_tokens)
        ]
        # The whole step's counts: every rank packs every micro-batch, so they are global.
        ctx = loss_context(batches, max_completion_length=self.config.sampling.max_new_tokens)
        batches = self._share(batches)
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
            for i, (mb, extra) in enumerate(zip(batches, loss_inputs, strict=True)):
                mb = mb.to(self.device)
                if self.world.size > 1:  # reduce-scatter the gradients once, after the last
                    self.model.set_requires_gradient_sync(i == len(batches) - 1)
                with self.autocast():
                    logp = self._logprobs(self.model, mb)
                    if extra is None:
                        prox = logp.detach()
                        extra = correction_inputs(
                            correction, mb.old_logprobs, lambda p=prox: p, is_cap
                        )
                    ref = None
                    if self.ref_model is not None:
                        with torch.no_grad():
                            ref = self._logprobs(self.ref_model, mb)
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
            total_loss, iteration_stats = self._sum_over_ranks(total_loss, iteration_stats)
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), g.max_grad_norm)
            if isinstance(grad_norm, DTensor):  # sharded: the norm over every rank's shard
                grad_norm = grad_norm.full_tensor()
            grad_norm = float(grad_norm)
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

    def _logprobs(self, model: torch.nn.Module, mb: PackedBatch) -> torch.Tensor:
        """`mb`'s per-token log-probabilities (R,) under `model`, the row split over the
        sequence-parallel group if there is one."""
        return packed_logprobs(model, mb, self.logprob_temperature, self.sequence_group)

    def _share(self, batches: list[PackedBatch]) -> list[PackedBatch]:
        """This rank's micro-batches: all of them in one process; on N ranks its data-parallel
        group's token-balanced share (a group is one rank, or P under sequence parallelism, all
        P with the same share), topped up with fully masked copies of the smallest one (zero
        loss and gradient) to the largest share's count, so every rank runs the same FSDP
        collectives."""
        if self.world.size == 1:
            return batches
        group = self.config.distributed.sequence_parallel_size  # ranks per data-parallel group
        sizes = [mb.input_ids.shape[1] for mb in batches]
        shares = balanced_split(sizes, self.world.size // group)
        mine = [batches[i] for i in shares[self.world.rank // group]]
        smallest = min(batches, key=lambda mb: mb.input_ids.shape[1])
        filler = replace(smallest, loss_mask=torch.zeros_like(smallest.loss_mask))
        return mine + [filler] * (max(map(len, shares)) - len(mine))

    def _sum_over_ranks(
        self, total_loss: float, iteration_stats: dict[str, float]
    ) -> tuple[float, dict[str, float]]:
        """The loss and the token-weighted stats summed over the ranks' micro-batches (the
        same keys, in the same order, on every rank). The P ranks of a sequence-parallel group
        each hold their micro-batches' whole loss, so the sum over ranks is divided by P."""
        if self.world.size == 1:
            return total_loss, iteration_stats
        values = torch.tensor([total_loss, *iteration_stats.values()], dtype=torch.float64)
        values = values.to(self.device)
        dist.all_reduce(values)
        values /= self.config.distributed.sequence_parallel_size
        total, *rest = values.tolist()
        return total, dict(zip(iteration_stats, rest, strict=True))

    def _correction_inputs(self, correction: str, mb: PackedBatch, is_cap: float) -> dict:
        """`policy_loss`'s correction arguments for `mb`, its proximal logprobs (R,) from one
        forward on the current weights where the correction needs them."""

        def proximal() -> torch.Tensor:
            with self.autocast():
                return self._logprobs(self.model, mb)

        return correction_inputs(correction, mb.old_logprobs, proximal, is_cap)

    def publish(self) -> dict[str, torch.Tensor]:
        """This version's weights for the rollout backends (`weights_snapshot`); rank 0 only."""
        if self.policy is None:
            raise RuntimeError(f"rank {self.world.rank} holds no full weights; rank 0 publishes")
        return weights_snapshot(self.policy)

    def save(
        self, root: Path, keep: int, state: dict[str, Any], tokenizer: Any = None
    ) -> Path | None:
        """Checkpoint weights, optimizer, RNG, the counters and the caller's `state` (and
        `tokenizer`, so the folder loads whole with `models.load_model`).

        One process writes the one-process checkpoint. On N ranks every rank calls it and
        writes its own shards (torch.distributed.checkpoint); nothing is gathered. Rank 0
        returns the folder, the others None, every rank once the checkpoint is complete."""
        state = {**state, "version": self.version}
        if self.world.size == 1:
            optimizer_state = self.optimizer.state_dict()
            return save_checkpoint(
                root, self.steps, self.model, optimizer_state, state, keep, tokenizer
            )
        with self._collective(f"writing checkpoint step {self.steps}"):
            path = save_sharded_checkpoint(
                root, self.steps, self.model, self.optimizer, state, keep, tokenizer
            )
            dist.barrier()  # rank 0 has renamed it: complete for every rank
        return path

    def load(self, path: Path) -> dict[str, Any]:
        """Resume from checkpoint `path`: weights, optimizer, RNG and counters; returns the
        state saved with it. On N ranks every rank calls it. Either format loads on any number
        of ranks (`training.checkpoint`); the same continuation as a straight run is checked
        for the same number (a different one changes how the batch is split, not the math)."""
        if self.world.size == 1:
            state = load_checkpoint(path, self.model, self.optimizer)
        else:
            with self._collective(f"loading checkpoint {path}"):
                state = load_checkpoint(path, self.model, self.optimizer, sharded=True)
                self._sync_policy()
        self.steps, self.version = state["step"], state["version"]
        return state
