"""DeepSpeed-Ulysses sequence parallelism (arXiv 2309.14509), as a transformers attention
implementation, so a Llama/Qwen-style HF model runs sequence-parallel without edits.

Each of P ranks holds N/P consecutive tokens of every sequence (and their position ids, so RoPE
rotates q and k locally). Around the attention kernel, an all-to-all swaps the sharding: q, k and v
go from (B, H, N/P, D) to (B, H/P, N, D), every rank runs causal attention over the whole sequence
for its H/P heads, and a second all-to-all swaps back. Projections, MLP and norms never see other
ranks. Per layer each rank sends 4·N·h/P values in forward (q, k, v and the output; h = H·D), the
same again in backward: constant as N and P grow together.

Choices and limits:
- GQA: when P does not divide the KV heads, k and v are repeated up to H heads before the swap
  (as ALST does); otherwise the KV heads are split and each rank repeats its own share.
- H must be divisible by P; otherwise a LeantrainError names the valid P values.
- Sequences are right-padded to a multiple of P. Causal attention keeps padding after every real
  token, so real tokens never see it; the padded positions get the IGNORE label (`shard_batch`).
- Packed rows (several sequences one after another, as the GRPO learner trains): inside
  `packed_sequences(position_ids)` attention is causal within each sequence of the full row and
  never crosses into another, one kernel call per sequence (no (N, N) mask is built). The caller
  passes the full row's position ids because a rank sees only N/P of them. Attention masks are
  not supported otherwise (left padding): the mask passed by the model is ignored.
- Sliding-window attention (a Qwen2 layer with `use_sliding_window`) is refused by name.

Knows nothing about training loops; `leantrain.distributed.sequence` builds the loss on top.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface

from leantrain.errors import LeantrainError

ATTENTION_NAME = "ulysses"


@dataclass
class CommStats:
    """Bytes this rank sent to other ranks through Ulysses all-to-alls (the share it keeps for
    itself is not sent), split by pass; `calls` counts forward all-to-alls."""

    forward_bytes: int = 0
    backward_bytes: int = 0
    calls: int = 0

    def reset(self) -> None:
        self.forward_bytes = self.backward_bytes = self.calls = 0


COMM = CommStats()


@dataclass
class _State:
    """The group attention swaps over (`register`; None: the world), and the lengths of the
    sequences packed in the full row while inside `packed_sequences` (None: one sequence)."""

    group: dist.ProcessGroup | None = None
    segments: list[int] | None = None


_STATE = _State()


def _swap(
    x: torch.Tensor, group: dist.ProcessGroup | None, scatter: int, gather: int
) -> torch.Tensor:
    """Split `x` into P chunks along `scatter`, send chunk j to rank j, and concatenate the P
    chunks received along `gather`."""
    world = dist.get_world_size(group)
    chunks = [c.contiguous() for c in x.chunk(world, dim=scatter)]
    received = [torch.empty_like(c) for c in chunks]
    dist.all_to_all(received, chunks, group=group)
    return torch.cat(received, dim=gather)


class _AllToAll(torch.autograd.Function):
    """Differentiable all-to-all: the backward is the same exchange with the dims swapped."""

    @staticmethod
    def forward(ctx, x, group, scatter, gather):  # type: ignore[override]
        ctx.group, ctx.scatter, ctx.gather = group, scatter, gather
        world = dist.get_world_size(group)
        COMM.forward_bytes += x.numel() * x.element_size() * (world - 1) // world
        COMM.calls += 1
        return _swap(x, group, scatter, gather)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        world = dist.get_world_size(ctx.group)
        COMM.backward_bytes += grad.numel() * grad.element_size() * (world - 1) // world
        return _swap(grad, ctx.group, ctx.gather, ctx.scatter), None, None, None


def seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """(B, H, N/P, D) sequence shard with all heads -> (B, H/P, N, D) full sequence, own heads."""
    return _AllToAll.apply(x, group, 1, 2)


def heads_to_seq(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """(B, H/P, N, D) -> (B, H, N/P, D): the inverse of `seq_to_heads`."""
    return _AllToAll.apply(x, group, 2, 1)


def check_heads(num_heads: int, world: int, setting: str = "sequence parallel size") -> None:
    """A LeantrainError naming `setting` and the valid sequence-parallel sizes if `world` does
    not divide the attention heads."""
    if num_heads % world:
        valid = [p for p in range(1, num_heads + 1) if num_heads % p == 0]
        raise LeantrainError(
            f"{setting} {world} does not divide the model's {num_heads} attention heads; "
            f"valid sizes: {valid}"
        )


def sequence_lengths(position_ids: torch.Tensor) -> list[int]:
    """The lengths of the sequences packed in a row, from its position ids (N,) or (1, N): a
    sequence starts at 0 and wherever a position does not continue the previous one by one (the
    rule transformers uses to detect packing). E.g. [0, 1, 2, 0, 1, 0] -> [3, 2, 1]."""
    positions = position_ids.reshape(-1).cpu()
    starts = torch.ones_like(positions, dtype=torch.bool)
    starts[1:] = positions[1:] - positions[:-1] != 1
    bounds = torch.cat([torch.nonzero(starts).flatten(), torch.tensor([positions.numel()])])
    return torch.diff(bounds).tolist()


@contextlib.contextmanager
def packed_sequences(position_ids: torch.Tensor) -> Iterator[None]:
    """Inside, Ulysses attention keeps apart the sequences packed in the full row whose position
    ids (N,) or (1, N) are given (the whole row, every rank's shard, padding included): each
    attends causally within itself only. Forward passes only; the backward needs nothing."""
    previous = _STATE.segments
    _STATE.segments = sequence_lengths(position_ids)
    try:
        yield
    finally:
        _STATE.segments = previous


def _causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float | None, dropout: float
) -> torch.Tensor:
    """Causal attention over the full sequence (B, H/P, N, D), per packed sequence inside
    `packed_sequences`."""
    segments = _STATE.segments
    if segments is None:
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=scaling, dropout_p=dropout
        )
    if sum(segments) != q.shape[2]:
        raise LeantrainError(
            f"packed_sequences was given a row of {sum(segments)} positions but the attention "
            f"sees {q.shape[2]}: pass the full row's position ids, padding included"
        )
    parts = zip(*(t.split(segments, dim=2) for t in (q, k, v)), strict=True)
    return torch.cat(
        [
            F.scaled_dot_product_attention(
                q_i, k_i, v_i, is_causal=True, scale=scaling, dropout_p=dropout
            )
            for q_i, k_i, v_i in parts
        ],
        dim=2,
    )


def ulysses_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """The transformers attention interface: q (B, H, N/P, D), k and v (B, Hkv, N/P, D), all
    rotated already; returns the attention output (B, N/P, H, D) and no weights."""
    if kwargs.get("sliding_window") is not None:
        raise LeantrainError(
            f"Ulysses attention does not support sliding-window attention (window "
            f"{kwargs['sliding_window']}); turn it off in the model config (use_sliding_window)"
        )
    group = _STATE.group
    world = dist.get_world_size(group)
    heads, kv_heads = query.shape[1], key.shape[1]
    check_heads(heads, world)
    if kv_heads % world:  # too few KV heads to split: give every query head its own copy
        key = key.repeat_interleave(heads // kv_heads, dim=1)
        value = value.repeat_interleave(heads // kv_heads, dim=1)
    q, k, v = (seq_to_heads(t, group) for t in (query, key, value))
    if k.shape[1] != q.shape[1]:  # this rank's KV heads serve its query heads in groups
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    out = _causal_attention(q, k, v, scaling, dropout if module.training else 0.0)  # (B, H/P, N, D)
    return heads_to_seq(out, group).transpose(1, 2).contiguous(), None


def register(group: dist.ProcessGroup | None = None) -> str:
    """Register `ulysses_attention` over `group` (default: the world) with transformers and
    return its name, for `model.set_attn_implementation(name)`."""
    _STATE.group = group
    AttentionInterface.register(ATTENTION_NAME, ulysses_attention)
    return ATTENTION_NAME
