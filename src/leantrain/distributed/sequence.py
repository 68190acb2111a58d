"""Training under Ulysses sequence parallelism: split a batch's tokens across ranks, a
token-weighted loss that equals the single-process loss, and gradients summed over ranks. Also
the pieces a packed-row learner builds on (`rl.learner`): the ranks' sequence-parallel groups,
a packed row split over them, and per-token values assembled from every rank's share.

Labels are shifted on the full sequence before it is split (the label of the last token of shard
j is the first token of shard j+1), so each rank scores exactly its own positions. Every rank gets
the same full batch (same seed), so the global count of labelled tokens is known everywhere
without communication; each rank backpropagates sum(its losses) / global count, and the sum of
the ranks' gradients is the gradient of the single-process mean.

Knows nothing about optimizers or run folders; `SequenceParallelHooks` plugs into any loop that
takes a `backward(model, chunks)` (as `leantrain.memory.sft.SFTRun` does).
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Iterator, Sequence
from typing import TypeVar

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from leantrain.distributed import ulysses
from leantrain.distributed.process_group import World
from leantrain.errors import LeantrainError
from leantrain.models.finetune import IGNORE
from leantrain.models.vision import is_vision_config

T = TypeVar("T")


def shard_batch(
    ids: torch.Tensor, labels: torch.Tensor, rank: int, world: int, pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's (input ids, position ids, shifted labels), each (B, ceil(T/P)).

    `labels` (B, T) are the usual unshifted labels (IGNORE where no loss). The sequence is right-
    padded to a multiple of `world`; padded positions carry IGNORE and never reach real tokens
    under causal attention.
    """
    batch, length = ids.shape
    shifted = torch.full_like(labels, IGNORE)
    shifted[:, :-1] = labels[:, 1:]
    local = -(-length // world)  # ceil
    pad = local * world - length
    ids = F.pad(ids, (0, pad), value=pad_id)
    shifted = F.pad(shifted, (0, pad), value=IGNORE)
    positions = torch.arange(local * world).expand(batch, -1)
    part = slice(rank * local, (rank + 1) * local)
    return ids[:, part], positions[:, part], shifted[:, part]


def check_ranks(ranks: int, size: int, setting: str) -> None:
    """A LeantrainError naming `setting` when a sequence-parallel `size` does not divide the
    number of ranks."""
    if size < 1 or ranks % size:
        raise LeantrainError(
            f"{setting} = {size} must divide the number of ranks ({ranks}); launch a "
            f"multiple of {size} ranks (`--nproc-per-node`) or lower {setting}"
        )


def check_model(model: torch.nn.Module, size: int, setting: str) -> None:
    """A LeantrainError naming `setting` when Ulysses cannot split `model`'s sequences over
    `size` ranks: a vision-language model, attention outside transformers' attention interface,
    a head count `size` does not divide, or sliding-window layers. Needs no other rank, so every
    rank refuses the same model before any collective."""
    if is_vision_config(model.config):
        raise LeantrainError(
            f"{setting} = {size} trains text-only models; {type(model).__name__} is a "
            "vision-language model, whose image tokens are not split across ranks yet"
        )
    if not getattr(model, "_supports_attention_backend", False):
        raise LeantrainError(
            f"{setting} = {size} needs a model whose attention goes through transformers' "
            f"attention interface (Llama, Qwen2, ...); {type(model).__name__} does not"
        )
    ulysses.check_heads(model.config.num_attention_heads, size, setting)
    if "sliding_attention" in (getattr(model.config, "layer_types", None) or []):
        raise LeantrainError(
            f"{setting} = {size} needs full attention in every layer; this model has "
            "sliding-window layers (Qwen2's use_sliding_window), which Ulysses does not split"
        )


def sequence_group(world: World, size: int, setting: str) -> dist.ProcessGroup:
    """This rank's sequence-parallel group: ranks are grouped by `size` consecutive ones
    ([0..size-1], [size..2size-1], ...), each group one data-parallel replica. A collective:
    every rank calls it, in the same order. Raises a LeantrainError naming `setting` when
    `size` does not divide the number of ranks (`check_ranks`), before communicating."""
    check_ranks(world.size, size, setting)
    timeout = datetime.timedelta(seconds=world.timeout_s)
    groups = [
        dist.new_group(list(range(first, first + size)), timeout=timeout)
        for first in range(0, world.size, size)
    ]
    return groups[world.rank // size]


def shard_row(
    input_ids: torch.Tensor,  # (1, T) a packed row
    position_ids: torch.Tensor,  # (1, T) restarting at 0 at each packed sequence
    rank: int,
    world: int,
    pad_id: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Split a packed row over `world` ranks: this rank's input ids and position ids, each
    (1, T'/P), the full row's position ids (1, T') for `ulysses.packed_sequences`, and the row
    index of this rank's first token; T' is T rounded up to a multiple of P.

    The padding is a sequence of its own (positions from 0) after every real token, so with
    attention kept inside each packed sequence no real token sees it, and it predicts nothing
    anyone reads.
    """
    length = input_ids.shape[1]
    local = -(-length // world)  # ceil
    pad = local * world - length
    ids = F.pad(input_ids, (0, pad), value=pad_id)
    padding = torch.arange(pad, device=position_ids.device, dtype=position_ids.dtype)
    positions = torch.cat([position_ids, padding[None]], dim=1)
    part = slice(rank * local, (rank + 1) * local)
    return ids[:, part], positions[:, part], positions, rank * local


def gather_owned(
    local: torch.Tensor,  # (R_own,) this rank's values, in `owned` order
    owned: torch.Tensor,  # (R,) bool: which entries this rank computed
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:  # (R,)
    """A flat tensor whose entries the ranks of `group` computed between them (each entry on
    exactly one rank), whole on every rank: one all-reduce of R values.

    Gradient flows into this rank's own entries only; the others are detached copies. So when
    every rank computes the same loss on the result and backpropagates it, rank r's backward
    carries dL/d(its entries), and the ranks' parameter gradients sum to dL/dθ, whatever the
    loss (no rank's loss counts any entry twice).
    """
    whole = torch.zeros(owned.shape, dtype=local.dtype, device=local.device)
    whole[owned] = local.detach()
    dist.all_reduce(whole, group=group)
    return whole.masked_scatter(owned, local)


def local_loss_sum(model: PreTrainedModel, ids, positions, shifted) -> torch.Tensor:
    """Sum of next-token cross-entropies over this rank's labelled positions."""
    logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits
    return F.cross_entropy(
        logits.float().flatten(0, 1), shifted.flatten(), ignore_index=IGNORE, reduction="sum"
    )


def all_reduce_grads(model: torch.nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Sum every trainable parameter's gradient over the group (one flat buffer, one call)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.flatten() for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def sequence_parallel_backward(
    model: PreTrainedModel,
    chunks: Sequence[tuple[torch.Tensor, torch.Tensor]],
    pad_id: int,
    group: dist.ProcessGroup | None = None,
) -> float:
    """`models.finetune.backward_token_mean` across the ranks of `group`: every rank passes the
    same `chunks`; afterwards every rank holds the full gradient. Returns the mean loss."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    device = next(model.parameters()).device
    n_tokens = sum(int((labels[:, 1:] != IGNORE).sum()) for _, labels in chunks)
    total = torch.zeros((), device=device)
    for ids, labels in chunks:
        local = [t.to(device) for t in shard_batch(ids, labels, rank, world, pad_id)]
        loss = local_loss_sum(model, *local) / max(1, n_tokens)
        loss.backward()
        total += loss.detach()
    all_reduce_grads(model, group)
    dist.all_reduce(total, group=group)
    return float(total)


class SequenceParallelHooks:
    """Step hooks for an SFT loop (`leantrain.memory.sft.StepHooks`'s members): backward through
    Ulysses attention over `group`, rank 0 evaluates and writes."""

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        setting: str = "distributed.sequence_parallel_size",
    ) -> None:
        """`setting` names the group's size in the errors of a model it cannot split."""
        self.group = group
        self.setting = setting
        self.is_main = dist.get_rank(group) == 0
        self.pad_id = 0
        self.previous = "sdpa"

    def attach(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> None:
        """Refuse a model Ulysses cannot split (`check_model`), then switch `model`'s attention
        to Ulysses over the group."""
        check_model(model, dist.get_world_size(self.group), self.setting)
        self.pad_id = tokenizer.pad_token_id
        self.previous = model.config._attn_implementation
        model.set_attn_implementation(ulysses.register(self.group))

    def share(self, pairs: Sequence[T]) -> list[T]:
        """Every rank trains on the whole batch (each on its part of every sequence)."""
        return list(pairs)

    def backward(
        self, model: PreTrainedModel, chunks: Sequence[tuple[torch.Tensor, torch.Tensor]]
    ) -> float:
        return sequence_parallel_backward(model, chunks, self.pad_id, self.group)

    def gather(self, model: PreTrainedModel) -> None:
        """Every rank already holds the full weights."""

    @contextlib.contextmanager
    def single_process(self, model: PreTrainedModel) -> Iterator[PreTrainedModel]:
        """`model` with its own attention while inside (evaluation on one rank)."""
        model.set_attn_implementation(self.previous)
        try:
            yield model
        finally:
            model.set_attn_implementation(ulysses.ATTENTION_NAME)
