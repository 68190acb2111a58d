"""Data-parallel supervised fine-tuning over the ranks torchrun started: each rank trains on its
token-balanced share of every batch's rows, every rank's loss is its exact share of the
single-process loss, and FSDP2 sums the gradients, so N ranks take the single-process step.

- **Shares.** Every rank draws the same batch (same seed); `share` keeps this rank's rows, dealt
  by `balanced_split` on their lengths (equal row counts, balanced tokens; the same split on
  every rank). A batch whose size the rank count does not divide is refused by the caller.
- **Normalisation.** One all-reduce gives the labelled tokens of all ranks' rows; each rank
  backpropagates the sum of its next-token losses divided by that global count, over any number
  of chunks. FSDP's reduce-scatter SUMS the ranks' gradients (`fsdp.shard`, divide factor 1),
  which is the gradient of the single-process token mean, as in the GRPO learner.
- **Writing.** Rank 0 keeps an unsharded copy of the model (made before sharding) that evaluates
  before training and, once `gather` has copied the trained weights into it, after; only rank 0
  writes the run folder.

Knows nothing about optimizers or run folders; `DataParallelHooks` plugs into any loop that takes
`leantrain.memory.sft.StepHooks`'s members (as `SFTRun` does).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from leantrain.distributed.fsdp import balanced_split, full_state_dict, shard
from leantrain.distributed.process_group import World, collective
from leantrain.distributed.sequence import local_loss_sum, shard_batch
from leantrain.models.finetune import IGNORE

Pair = tuple[list[int], list[int]]


def data_parallel_backward(
    model: torch.nn.Module,
    chunks: Sequence[tuple[torch.Tensor, torch.Tensor]],
    pad_id: int,
    group: dist.ProcessGroup | None = None,
) -> tuple[float, dict[str, float]]:
    """Backward of this rank's share of the token-mean next-token loss over every rank's
    `chunks` (each rank passes its own). Every rank must call it with the same number of chunks
    (FSDP's collectives pair up forward by forward).

    Returns the whole step's mean loss and {"tokens": the padded tokens of all ranks' chunks}.
    """
    device = next(model.parameters()).device
    counts = torch.tensor(
        [sum(int((labels[:, 1:] != IGNORE).sum()) for _, labels in chunks)], device=device
    )
    dist.all_reduce(counts, group=group)
    n_tokens = max(1, int(counts[0]))
    total = torch.zeros(2, dtype=torch.float64, device=device)  # loss, padded tokens
    for i, (ids, labels) in enumerate(chunks):
        if isinstance(model, FSDPModule):  # reduce-scatter once, after the last chunk
            model.set_requires_gradient_sync(i == len(chunks) - 1)
        # World 1: the whole sequence, labels shifted, position ids 0..T-1.
        local = [t.to(device) for t in shard_batch(ids, labels, 0, 1, pad_id)]
        loss = local_loss_sum(model, *local) / n_tokens  # a chunk with no labels: zero
        loss.backward()
        total[0] += float(loss.detach())
        total[1] += ids.numel()
    dist.all_reduce(total, group=group)
    return float(total[0]), {"tokens": float(total[1])}


class DataParallelHooks:
    """Step hooks for an SFT loop (`leantrain.memory.sft.StepHooks`'s members) over `world`:
    FSDP2 sharding, token-balanced shares of each batch, an exact global normalisation; rank 0
    evaluates (on its unsharded copy) and writes.

    Attributes:
        policy: rank 0's unsharded copy of the model (None on the other ranks): what evaluates,
            holding the trained weights once `gather` has run.
    """

    def __init__(self, world: World) -> None:
        if world.size < 2:
            raise ValueError(f"data parallelism needs 2 or more ranks, got {world.size}")
        self.world = world
        self.is_main = world.is_main
        self.policy: torch.nn.Module | None = None
        self.pad_id = 0

    def attach(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
        """Keep rank 0's unsharded copy, then shard `model` in place (fp32 compute: the same
        numbers as one process, on any device)."""
        self.pad_id = tokenizer.pad_token_id
        if self.world.is_main:
            self.policy = copy.deepcopy(model)
        with collective(self.world, "sharding the model (FSDP2)"):
            shard(model)

    def share(self, pairs: Sequence[Pair]) -> list[Pair]:
        """This rank's rows of the step's batch (the same batch on every rank)."""
        if len(pairs) % self.world.size:
            raise ValueError(f"{self.world.size} ranks do not divide a batch of {len(pairs)}")
        bins = balanced_split([len(p) + len(c) for p, c in pairs], self.world.size)
        return [pairs[i] for i in bins[self.world.rank]]

    def backward(
        self, model: PreTrainedModel, chunks: Sequence[tuple[torch.Tensor, torch.Tensor]]
    ) -> tuple[float, dict[str, float]]:
        with collective(self.world, "a data-parallel SFT step"):
            return data_parallel_backward(model, chunks, self.pad_id)

    def gather(self, model: PreTrainedModel) -> None:
        """Every rank calls it after training: rank 0's copy takes the trained weights."""
        with collective(self.world, "gathering the trained weights to rank 0"):
            full = full_state_dict(model)
        if self.policy is not None:
            self.policy.load_state_dict(full)

    @contextlib.contextmanager
    def single_process(self, model: PreTrainedModel) -> Iterator[torch.nn.Module]:
        """Rank 0's unsharded copy (the sharded `model` cannot run on one rank alone)."""
        if self.policy is None:
            raise RuntimeError(f"rank {self.world.rank} holds no full weights; rank 0 evaluates")
        yield self.policy
