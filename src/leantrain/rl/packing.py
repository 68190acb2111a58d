"""Padding-free trainer batches: trajectories concatenated into one row, one forward pass over it,
and log-probabilities computed only where a response token is predicted. Also the token-budget
batcher that groups trajectories into such rows, the per-step token accounting (generated,
environment and truncated tokens, padding), and the padded layout packing replaces, kept as the
reference and the benchmark's baseline (`padded_logprobs`).

Knows nothing about rewards or loss variants: it carries one advantage per trajectory, broadcast
over that trajectory's response tokens, and hands flat per-token tensors to `rl.losses`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from itertools import chain

import torch
import torch.distributed as dist
from torch import Tensor, nn

from leantrain.distributed import gather_owned, packed_sequences, shard_row
from leantrain.errors import LeantrainError
from leantrain.rl.losses import LossContext
from leantrain.rl.trajectory import Trajectory
from leantrain.training.logprobs import token_logprobs

# Finish reasons of a response cut off before it was done: a turn's max_new_tokens ("length"),
# an episode's token budget or turn limit. `mask_truncated` drops these from the loss.
TRUNCATED = frozenset({"length", "budget", "max_turns"})


@dataclass(frozen=True)
class PackedBatch:
    """Trajectories packed into one row. T = all prompt and response tokens, R = response tokens.

    Attributes:
        input_ids: (1, T) every trajectory's prompt then response, one after another, no padding.
        position_ids: (1, T) restart at 0 at each trajectory; they also mark the boundaries the
            attention must not cross (see `packed_logprobs`).
        logit_positions: (R,) where in the row each response token is predicted from: the
            position just before it (logits at t predict the token at t + 1).
        targets: (R,) the response token ids, exactly as sampled.
        old_logprobs: (R,) behaviour log-probabilities from the rollout.
        loss_mask: (R,) float, 1 = trained on, 0 = tool/env token or masked truncated response.
        advantages: (R,) the trajectory's advantage on each of its response tokens.
        sequence_index: (R,) long, which trajectory of this batch (0..S-1) each token belongs to.
        num_sequences: S, the number of trajectories packed.
        pixel_values: (n_images, C, H, W) every trajectory's images in row order, which is the
            order of their image tokens in `input_ids` (a VLM fills those positions in order),
            so rows with images pack like any other; None when no trajectory has one.
    """

    input_ids: Tensor
    position_ids: Tensor
    logit_positions: Tensor
    targets: Tensor
    old_logprobs: Tensor
    loss_mask: Tensor
    advantages: Tensor
    sequence_index: Tensor
    num_sequences: int
    pixel_values: Tensor | None = None

    def to(self, device: torch.device | str) -> PackedBatch:
        """The same batch with every tensor on `device`."""
        moved = {
            f.name: getattr(self, f.name).to(device)
            for f in fields(self)
            if isinstance(getattr(self, f.name), Tensor)
        }
        return replace(self, **moved)


def pack(
    trajectories: Sequence[Trajectory],  # S trajectories
    advantages: Tensor,  # (S,) one advantage per trajectory
    mask_truncated: bool = False,
) -> PackedBatch:
    """Concatenate `trajectories` into one padding-free row.

    With `mask_truncated`, a trajectory that was cut off (finish reason in `TRUNCATED`: the
    length cap, an episode's token budget or turn limit) gets an all-zero loss mask: its reward
    judged an unfinished answer (TRL's `mask_truncated_completions`). It still counts as a
    sequence in the loss normalizations, as in TRL.
    """
    if len(trajectories) != advantages.shape[0]:
        raise ValueError(
            f"advantages has {advantages.shape[0]} entries, expected one per trajectory "
            f"({len(trajectories)})"
        )
    if not trajectories:
        raise ValueError("pack() needs at least one trajectory, got none")
    for i, traj in enumerate(trajectories):
        if not traj.prompt_ids:
            raise ValueError(
                f"trajectory {i} has empty prompt_ids: its first response token needs a "
                "preceding token to be predicted from (start prompts with BOS)"
            )
    prompt_lens = torch.tensor([len(t.prompt_ids) for t in trajectories])
    response_lens = torch.tensor([len(t.response_ids) for t in trajectories])
    seq_lens = prompt_lens + response_lens
    # Response token j of trajectory i sits at seq_start[i] + prompt_lens[i] + j and is
    # predicted from the position before it.
    first_logit = torch.cumsum(seq_lens, 0) - seq_lens + prompt_lens - 1
    logit_positions = first_logit.repeat_interleave(response_lens) + _index_within(response_lens)
    tokens = chain.from_iterable(t.prompt_ids + t.response_ids for t in trajectories)
    masks = chain.from_iterable(_loss_mask(t, mask_truncated) for t in trajectories)
    images = [t.pixel_values for t in trajectories if t.pixel_values is not None]
    return PackedBatch(
        input_ids=torch.tensor(list(tokens), dtype=torch.long)[None],
        position_ids=_index_within(seq_lens)[None],
        logit_positions=logit_positions,
        targets=torch.tensor(
            list(chain.from_iterable(t.response_ids for t in trajectories)), dtype=torch.long
        ),
        old_logprobs=torch.tensor(
            list(chain.from_iterable(t.logprobs for t in trajectories)), dtype=torch.float32
        ),
        loss_mask=torch.tensor(list(masks), dtype=torch.float32),
        # Built on the CPU like every other field; `PackedBatch.to` moves them together.
        advantages=advantages.detach().to("cpu", torch.float32).repeat_interleave(response_lens),
        sequence_index=torch.arange(len(trajectories)).repeat_interleave(response_lens),
        num_sequences=len(trajectories),
        pixel_values=torch.cat(images) if images else None,
    )


def _index_within(lengths: Tensor) -> Tensor:
    """Segment lengths (S,) -> (sum(lengths),) index of each element within its segment.

    E.g. [2, 3] -> [0, 1, 0, 1, 2].
    """
    starts = torch.cumsum(lengths, 0) - lengths
    return torch.arange(int(lengths.sum())) - starts.repeat_interleave(lengths)


def _loss_mask(traj: Trajectory, mask_truncated: bool) -> list[int]:
    """The trajectory's own mask, or all zeros when it is truncated and those are masked."""
    if mask_truncated and traj.finish_reason in TRUNCATED:
        return [0] * len(traj.response_ids)
    return list(traj.loss_mask)


def packed_logprobs(
    model: nn.Module,  # a Hugging Face causal LM (or a peft wrapper of one)
    batch: PackedBatch,  # on the model's device
    temperature: float = 1.0,
    sequence_group: dist.ProcessGroup | None = None,
) -> Tensor:  # (R,) float32, with grad through the model
    """log softmax(logits / temperature) at each response token (`training.logprobs`), from one
    forward over the row.

    Logits are computed only at `batch.logit_positions` (transformers' `logits_to_keep` with an
    index tensor slices the hidden states before the LM head), so the (T, vocab) logits of the
    prompt tokens are never materialized. Divide by the same temperature the rollout sampled with,
    so the result is comparable with `old_logprobs`.

    Sequences are kept apart by `position_ids` alone: with no attention mask and no cache,
    transformers detects the restarts and builds a block-diagonal causal mask (sdpa, eager, flex),
    and flash-attention turns them into `cu_seqlens`. `use_cache=False` is required: with a cache
    (created by default when `config.use_cache` is on) the detection is skipped and later
    sequences attend to earlier ones. A hand-built 4-D boolean mask would be no better: sdpa
    accepts it, but eager adds it to the scores as 0/1 and silently mixes the sequences.

    With a `sequence_group`, the row is split over its ranks (`sequence_parallel_logprobs`).
    """
    if sequence_group is not None:
        return sequence_parallel_logprobs(model, batch, sequence_group, temperature)
    images = {} if batch.pixel_values is None else {"pixel_values": batch.pixel_values}
    out = model(
        input_ids=batch.input_ids,
        position_ids=batch.position_ids,
        use_cache=False,
        logits_to_keep=batch.logit_positions,
        **images,
    )
    return token_logprobs(out.logits[0], batch.targets, temperature)  # logits (R, vocab)


def sequence_parallel_logprobs(
    model: nn.Module,  # the causal LM, its attention switched to Ulysses over `group`
    batch: PackedBatch,  # the same batch on every rank of `group`, on the model's device
    group: dist.ProcessGroup,
    temperature: float = 1.0,
) -> Tensor:  # (R,) float32, the same values on every rank of `group`
    """`packed_logprobs` with the row split over the P ranks of `group` (Ulysses).

    Each rank runs the model on its T/P consecutive tokens (`distributed.shard_row`; their own
    position ids, so RoPE is local) with attention kept inside each packed sequence of the full
    row (`distributed.packed_sequences`), and computes logits only at the response positions
    that fall in its slice. The per-token log-probabilities are then assembled whole on every
    rank (`distributed.gather_owned`, one all-reduce of R floats), with gradient into this
    rank's own tokens only: every rank computes the whole micro-batch's loss from them, exactly
    as one process would, and the ranks' gradients sum to that loss's gradient.
    """
    if batch.pixel_values is not None:
        raise LeantrainError(
            "distributed.sequence_parallel_size > 1 trains text-only models; this batch has "
            "images (a vision-language model's image tokens cannot be split across ranks yet)"
        )
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    ids, positions, row_positions, start = shard_row(
        batch.input_ids, batch.position_ids, rank, size
    )
    stop = start + ids.shape[1]
    owned = (batch.logit_positions >= start) & (batch.logit_positions < stop)
    with packed_sequences(row_positions):
        out = model(
            input_ids=ids,
            position_ids=positions,
            use_cache=False,
            logits_to_keep=batch.logit_positions[owned] - start,
        )
    local = token_logprobs(out.logits[0], batch.targets[owned], temperature)
    return gather_owned(local, owned, group)


def micro_batches(trajectories: Sequence[Trajectory], max_tokens: int) -> list[list[int]]:
    """Group trajectories so each group's packed row (prompt + response tokens) fits `max_tokens`.

    First-fit decreasing: longest first, each into the first group with room, which keeps the
    number of forward passes close to the minimum. A trajectory longer than the budget gets a
    group of its own. Returns indices into `trajectories` (ascending within each group) so any
    per-trajectory array, such as the advantages, is split the same way; every index appears
    exactly once.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    lengths = [len(t.prompt_ids) + len(t.response_ids) for t in trajectories]
    groups: list[list[int]] = []
    room: list[int] = []  # tokens left in each group; negative for an oversized one
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        fit = next((g for g, free in enumerate(room) if lengths[i] <= free), None)
        if fit is None:
            groups.append([i])
            room.append(max_tokens - lengths[i])
        else:
            groups[fit].append(i)
            room[fit] -= lengths[i]
    return [sorted(group) for group in groups]


def loss_context(
    batches: Sequence[PackedBatch],  # every micro-batch of one optimizer step
    max_completion_length: int | None = None,
) -> LossContext:
    """The whole-step counts the loss weights divide by, from the packed micro-batches."""
    return LossContext(
        num_sequences=sum(b.num_sequences for b in batches),
        num_active_tokens=int(sum(b.loss_mask.sum().item() for b in batches)),
        max_completion_length=max_completion_length,
        num_micro_batches=len(batches),
    )


def _lengths(trajectories: Sequence[Trajectory]) -> list[int]:
    return [len(t.prompt_ids) + len(t.response_ids) for t in trajectories]


def padding_fraction(
    trajectories: Sequence[Trajectory], groups: Sequence[Sequence[int]], packed: bool
) -> float:
    """Share of the token slots in the forward passes over `groups` that hold padding.

    Packed, a group is one row of exactly its tokens; padded, it is one row per trajectory, each
    as long as the group's longest prompt plus its longest response (`padded_logprobs`' layout).
    """
    lengths = _lengths(trajectories)
    real = sum(lengths[i] for group in groups for i in group)
    if packed:
        slots = real
    else:
        slots = sum(
            len(group)
            * (
                max(len(trajectories[i].prompt_ids) for i in group)
                + max(len(trajectories[i].response_ids) for i in group)
            )
            for group in groups
        )
    return 1.0 - real / max(slots, 1)


def token_metrics(trajectories: Sequence[Trajectory], micro_batch_tokens: int) -> dict[str, float]:
    """One training step's token accounting, for the metrics log.

    generated_tokens: sampled tokens (loss mask 1); env_tokens: environment tokens in the
    context (loss mask 0); truncated_tokens: response tokens of cut-off trajectories
    (`TRUNCATED`); padding_fraction: padding in the trainer's packed micro-batches (0 when
    packing works); padding_fraction_padded: what padding the same micro-batches would waste.
    """
    groups = micro_batches(trajectories, micro_batch_tokens)
    return {
        "generated_tokens": float(sum(sum(t.loss_mask) for t in trajectories)),
        "env_tokens": float(sum(len(t.loss_mask) - sum(t.loss_mask) for t in trajectories)),
        "truncated_tokens": float(
            sum(len(t.response_ids) for t in trajectories if t.finish_reason in TRUNCATED)
        ),
        "padding_fraction": padding_fraction(trajectories, groups, packed=True),
        "padding_fraction_padded": padding_fraction(trajectories, groups, packed=False),
    }


def padded_logprobs(
    model: nn.Module,  # a Hugging Face causal LM
    trajectories: Sequence[Trajectory],  # S trajectories, one padded row each
    temperature: float = 1.0,
    pad_id: int = 0,
) -> Tensor:  # (R,) float32, in `pack(trajectories, ...).targets` order
    """`packed_logprobs` computed the padded way (TRL's layout): prompts left-padded, responses
    right-padded, one (S, P_max + R_max) forward with an attention mask, logits kept for the
    response columns only. The same numbers as packing, at the cost of the padded slots.
    """
    p_max = max(len(t.prompt_ids) for t in trajectories)
    r_max = max(len(t.response_ids) for t in trajectories)
    rows, masks = [], []
    for t in trajectories:
        p_pad, r_pad = p_max - len(t.prompt_ids), r_max - len(t.response_ids)
        rows.append([pad_id] * p_pad + t.prompt_ids + t.response_ids + [pad_id] * r_pad)
        masks.append([0] * p_pad + [1] * (len(t.prompt_ids) + len(t.response_ids)) + [0] * r_pad)
    device = next(model.parameters()).device
    input_ids = torch.tensor(rows, device=device)  # (S, P_max + R_max)
    attention_mask = torch.tensor(masks, device=device)
    # Left padding shifts positions; count them from each row's first real token, as packing does.
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=False,
        logits_to_keep=r_max + 1,
    )
    # Logits (S, R_max, vocab) predict the response columns (S, R_max).
    logp = token_logprobs(out.logits[:, :-1], input_ids[:, p_max:], temperature)
    real = attention_mask[:, p_max:].bool()  # row-major, so the order matches pack()'s targets
    return logp[real]
