"""Data-parallel supervised fine-tuning over the ranks torchrun started: each rank trains on its
token-balanced share of every batch's rows, every rank's loss is its exact share of the
single-process loss, and FSDP2 sums the gradients, so N ranks take the single-process step.
Optionally sequence-parallel inside that (DeepSpeed-Ulysses, as in the GRPO learner and verl):
the ranks form N/P data-parallel groups of P consecutive ranks, and the P ranks of a group split
every sequence of their share between them.

- **Shares.** Every rank draws the same batch (same seed); `share` keeps this rank's rows, dealt
  by `balanced_split` on their lengths (equal row counts, balanced tokens; the same split on
  every rank) to the data-parallel groups: a rank, or the P ranks of a sequence-parallel group,
  which all keep the same rows. A batch whose size the groups do not divide is refused by the
  caller.
- **Sequence split.** Under P > 1 the model's attention is Ulysses over the rank's group
  (`ulysses.register`), and each rank feeds its 1/P of every chunk's positions, labels shifted
  on the whole sequence first (`sequence.shard_batch`), so it scores exactly its own tokens.
- **Normalisation.** One all-reduce gives the labelled tokens of all ranks' rows (divided by P:
  a group's ranks hold the same rows); each rank backpropagates the sum of its next-token losses
  divided by that global count, over any number of chunks. FSDP's reduce-scatter SUMS the
  ranks' gradients over the whole world (`fsdp.shard`, divide factor 1), which is the gradient
  of the single-process token mean, as in the GRPO learner: under SP each rank's backward
  carries, through the all-to-alls, the gradient of its own tokens' losses.
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

from leantrain.distributed import ulysses
from leantrain.distributed.fsdp import balanced_split, full_state_dict, shard
from leantrain.distributed.process_group import World, collective
from leantrain.distributed.sequence import (
    check_model,
    check_ranks,
    local_loss_sum,
    sequence_group,
    shard_batch,
)
from leantrain.models.finetune import IGNORE

Pair = tuple[list[int], list[int]]


def data_parallel_backward(
    model: torch.nn.Module,
    chunks: Sequence[tuple[torch.Tensor, torch.Tensor]],
    pad_id: int,
    group: dist.ProcessGroup | None = None,
    sequence: dist.ProcessGroup | None = None,
) -> tuple[float, dict[str, float]]:
    """Backward of this rank's share of the token-mean next-token loss over every rank's
    `chunks` (each rank passes its own; the ranks of a `sequence`-parallel group pass the same
    ones, each scoring its 1/P of every sequence through Ulysses attention over that group).
    Every rank must call it with the same number of chunks (FSDP's collectives pair up forward
    by forward). `group`: the ranks the step spans (None: the world).

    Returns the whole step's mean loss and {"tokens": the padded tokens of all groups' chunks}.
    """
    device = next(model.parameters()).device
    part, parts = (
        (0, 1) if sequence is None else (dist.get_rank(sequence), dist.get_world_size(sequence))
    )
    counts = torch.tensor(
        [sum(int((labels[:, 1:] != IGNORE).sum()) for _, labels in chunks)], device=device
    )
    dist.all_reduce(counts, group=group)
    n_tokens = max(1, int(counts[0]) // parts)  # each group's rows were counted by its P ranks
    total = torch.zeros(2, dtype=torch.float64, device=device)  # loss, padded tokens
    for i, (ids, labels) in enumerate(chunks):
        if isinstance(model, FSDPModule):  # reduce-scatter once, after the last chunk
            model.set_requires_gradient_sync(i == len(chunks) - 1)
        # This rank's positions (all of them without SP), labels shifted on the whole sequence.
        local = [t.to(device) for t in shard_batch(ids, labels, part, parts, pad_id)]
        loss = local_loss_sum(model, *local) / n_tokens  # a chunk with no labels: zero
        loss.backward()
        total[0] += float(loss.detach())
        total[1] += ids.numel() / parts  # a group's P ranks share each chunk's tokens
    dist.all_reduce(total, group=group)
    return float(total[0]), {"tokens": float(total[1])}


class DataParallelHooks:
    """Step hooks for an SFT loop (`leantrain.memory.sft.StepHooks`'s members) over `world`:
    FSDP2 sharding, token-balanced shares of each batch, an exact global normalisation; rank 0
    evaluates (on its unsharded copy) and writes. With `sequence_parallel` P > 1 the ranks form
    world/P data-parallel groups of P consecutive ranks that split each sequence (Ulysses).

    Attributes:
        policy: rank 0's unsharded copy of the model (None on the other ranks): what evaluates,
            holding the trained weights once `gather` has run.
        sequence: this rank's sequence-parallel group once `attach` has run (None without SP).
    """

    def __init__(
        self,
        world: World,
        sequence_parallel: int = 1,
        setting: str = "distributed.sequence_parallel_size",
    ) -> None:
        """`setting` names `sequence_parallel` in errors (a size that does not divide the
        ranks, raised here, or the model's attention heads, raised by `attach`)."""
        if world.size < 2:
            raise ValueError(f"data parallelism needs 2 or more ranks, got {world.size}")
        check_ranks(world.size, sequence_parallel, setting)
        self.world = world
        self.is_main = world.is_main
        self.sequence_parallel = sequence_parallel
        self.setting = setting
        self.groups = world.size // sequence_parallel
        self.policy: torch.nn.Module | None = None
        self.sequence: dist.ProcessGroup | None = None
        self.pad_id = 0

    def attach(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
        """Keep rank 0's unsharded copy (with the model's own attention), switch `model`'s
        attention to Ulysses over this rank's sequence-parallel group if there is one, then
        shard it in place (fp32 compute: the same numbers as one process, on any device)."""
        if self.sequence_parallel > 1:
            # Every rank refuses the same model before any collective: none waits for another.
            check_model(model, self.sequence_parallel, self.setting)
        self.pad_id = tokenizer.pad_token_id
        if self.world.is_main:
            self.policy = copy.deepcopy(model)
        if self.sequence_parallel > 1:
            with collective(self.world, "creating the sequence-parallel groups"):
                self.sequence = sequence_group(self.world, self.sequence_parallel, self.setting)
            model.set_attn_implementation(ulysses.register(self.sequence))
        with collective(self.world, "sharding the model (FSDP2)"):
            shard(model)

    def share(self, pairs: Sequence[Pair]) -> list[Pair]:
        """This rank's rows of the step's batch (the same batch on every rank): its
        data-parallel group's share, the same on every rank of a sequence-parallel group."""
        if len(pairs) % self.groups:
            raise ValueError(
                f"{self.groups} data-parallel groups do not divide a batch of {len(pairs)}"
            )
        bins = balanced_split([len(p) + len(c) for p, c in pairs], self.groups)
        return [pairs[i] for i in bins[self.world.rank // self.sequence_parallel]]

    def backward(
        self, model: PreTrainedModel, chunks: Sequence[tuple[torch.Tensor, torch.Tensor]]
    ) -> tuple[float, dict[str, float]]:
        with collective(self.world, "a data-parallel SFT step"):
            return data_parallel_backward(model, chunks, self.pad_id, sequence=self.sequence)

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
