"""Supervised fine-tuning primitives shared by every area that fine-tunes: batching prompt and
completion token ids into right-padded chunks with labels, and one token-weighted backward pass
over a batch split into chunks. The loop around them is `training.sft.SFTLoop`; LoRA, LARS and
logging belong to the caller."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from transformers import PreTrainedModel

IGNORE = -100  # label of a position that gets no loss (prompt, padding)


def completion_chunks(
    pairs: Sequence[tuple[Sequence[int], Sequence[int]]], pad_id: int, chunks: int = 1
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(prompt ids, completion ids) pairs as `chunks` right-padded (input ids, labels) tensors,
    each (b, T). Labels are IGNORE on the prompt and padding, so the loss is on completions only.

    Pairs are sorted by length before chunking, so with heavy-tailed lengths little compute goes
    to padding. Right padding needs no attention mask in a causal model (pads come after every
    real token), which keeps attention on its fast causal path.
    """
    rows = [
        ([*prompt, *completion], [IGNORE] * len(prompt) + list(completion))
        for prompt, completion in pairs
    ]
    rows.sort(key=lambda r: len(r[0]))  # stable: equal lengths keep their order
    size = math.ceil(len(rows) / chunks)
    out = []
    for start in range(0, len(rows), size):
        part = rows[start : start + size]
        width = max(len(ids) for ids, _ in part)
        ids = torch.tensor([r + [pad_id] * (width - len(r)) for r, _ in part])
        labels = torch.tensor([lab + [IGNORE] * (width - len(lab)) for _, lab in part])
        out.append((ids, labels))
    return out


def backward_token_mean(
    model: PreTrainedModel, chunks: Sequence[tuple[torch.Tensor, torch.Tensor]]
) -> float:
    """Backward of the mean next-token loss over every labelled token of all `chunks` (each
    chunk's mean re-weighted by its share of the tokens, so chunking does not change the
    gradient). Returns that mean loss; gradients accumulate in the parameters."""
    device = next(model.parameters()).device
    n_tokens = sum(int((labels[:, 1:] != IGNORE).sum()) for _, labels in chunks)
    total = 0.0
    for ids, labels in chunks:
        n = int((labels[:, 1:] != IGNORE).sum())
        if n == 0:
            continue
        # Only the loss is kept: holding the output would keep its (B, T, V) logits alive
        # through backward, which needs just the loss's own saved tensors.
        loss = model(input_ids=ids.to(device), labels=labels.to(device), use_cache=False).loss
        loss = loss * (n / n_tokens)
        loss.backward()
        total += float(loss.detach())
    return total
