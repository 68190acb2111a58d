"""Batched scoring: the log-probability a causal LM gives to labelled tokens, per sequence, in one
forward over a right-padded batch.

This is the prefill half of the rollout engine's forward path (token ids in, fp32 log-softmax of
the model's logits out) without sampling or a KV cache: whatever gets scored many times under
slightly different weights (ZO perturbations, label verbalisers, held-out losses) goes through it.

Labels follow the Hugging Face convention of `models.finetune`: `labels[i, t]` is the token at
position t (scored from the logits at t - 1), or IGNORE where there is nothing to score (prompt,
padding). Right padding needs no attention mask in a causal model, since pads come after every
real token; the lm_head runs only from the first labelled position on (`logits_to_keep`), so a
long prompt costs no vocabulary-sized logits.

What it does NOT know about: tokenization, tasks, which weights the model holds (adapters,
perturbations), gradients (call it under `torch.inference_mode()` when none are wanted).
"""

from __future__ import annotations

import inspect

import torch
from transformers import PreTrainedModel

from leantrain.errors import LeantrainError
from leantrain.models.finetune import IGNORE


def label_logprobs(
    model: PreTrainedModel, input_ids: torch.Tensor, labels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of log p(label token) over each row's labelled positions, and how many there are.

    Args:
        model: any HF causal LM, on its own device and dtype.
        input_ids: (N, T) right-padded token ids.
        labels: (N, T) the token to score at each position, IGNORE elsewhere; position 0 is never
            scored (nothing precedes it).

    Returns:
        (N,) fp32 summed log-probabilities and (N,) long counts of scored tokens, on the model's
        device. A row with nothing to score gets 0 and 0.
    """
    if input_ids.dim() != 2 or input_ids.shape != labels.shape:
        raise LeantrainError(
            f"input_ids and labels must both be (N, T); got {tuple(input_ids.shape)} and "
            f"{tuple(labels.shape)}"
        )
    device = next(model.parameters()).device
    input_ids, labels = input_ids.to(device), labels.to(device)
    targets = labels[:, 1:]  # (N, T-1): the token predicted from each position 0..T-2
    scored = targets != IGNORE
    counts = scored.sum(-1)
    if not bool(scored.any()):
        return torch.zeros(len(labels), device=device), counts
    # Logits are needed from the first position that predicts a labelled token to T-2.
    first = int(scored.any(0).nonzero()[0])
    keep = input_ids.shape[1] - first  # positions first..T-1 (the last one predicts nothing)
    logits = _forward_logits(model, input_ids, keep)[:, :-1]  # (N, T-1-first, V)
    logp = torch.log_softmax(logits.float(), dim=-1)
    window = targets[:, first:]
    picked = logp.gather(-1, window.clamp(min=0).unsqueeze(-1)).squeeze(-1)  # (N, T-1-first)
    return torch.where(scored[:, first:], picked, 0.0).sum(-1), counts


def _forward_logits(model: PreTrainedModel, input_ids: torch.Tensor, keep: int) -> torch.Tensor:
    """Logits of the last `keep` positions, (N, keep, V), asking the model for no more where it
    supports `logits_to_keep`."""
    if "logits_to_keep" in _forward_parameters(model):
        return model(input_ids=input_ids, use_cache=False, logits_to_keep=keep).logits
    return model(input_ids=input_ids, use_cache=False).logits[:, -keep:]


def _forward_parameters(model: PreTrainedModel) -> frozenset[str]:
    """Keyword names `model.forward` takes (peft wrappers pass **kwargs on to the base model)."""
    base = getattr(model, "get_base_model", lambda: model)()
    return frozenset(inspect.signature(base.forward).parameters)
