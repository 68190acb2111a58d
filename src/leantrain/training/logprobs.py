"""Token log-probabilities: the one scorer every trainer and evaluator uses.

`token_logprobs` is the arithmetic: `log_softmax(logits / temperature)` gathered at the target
ids, in fp32, as the gathered logit minus the logsumexp, so no second vocabulary-sized tensor is
made. Everything else here is a forward that feeds it:

- `label_logprobs`: a right-padded batch with Hugging Face-style labels (the convention of
  `models.finetune`): `labels[i, t]` is the token at position t (scored from the logits at
  t - 1), or IGNORE where there is nothing to score (prompt, padding). Right padding needs no
  attention mask in a causal model, since pads come after every real token; the lm_head runs
  only from the first labelled position on (`logits_to_keep`), so a long prompt costs no
  vocabulary-sized logits. Whatever gets scored many times under slightly different weights
  (ZO perturbations, label verbalisers, held-out losses, NPO's sequence likelihoods) goes
  through it.
- The RL learner's packed rows and their padded baseline (`rl.packing.packed_logprobs`,
  `padded_logprobs`) and the ZO lean forward (`zo.packed.LeanLlama`) run their own forwards,
  since their layouts are theirs, and call `token_logprobs` on the logits.

What it does NOT know about: tokenization, tasks, which weights the model holds (adapters,
perturbations), gradients (call it under `torch.inference_mode()` when none are wanted).
"""

from __future__ import annotations

import inspect

import torch
from transformers import PreTrainedModel

from leantrain.errors import LeantrainError
from leantrain.models.finetune import IGNORE


def token_logprobs(
    logits: torch.Tensor,  # (..., V) any float dtype
    targets: torch.Tensor,  # (...) long token ids
    temperature: float = 1.0,
) -> torch.Tensor:  # (...) float32, with grad through `logits`
    """`log_softmax(logits / temperature)` at `targets`.

    The logits are upcast to fp32 for a stable logsumexp (bf16 logits lose the small
    probabilities). Divide by the temperature the tokens were sampled with, so the result is
    comparable with the engine's behaviour logprobs; at 1 no scaled copy is made (dividing by 1
    is exact, so the numbers are the same either way).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    return logits.gather(-1, targets[..., None]).squeeze(-1) - logits.logsumexp(-1)


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
        (N,) fp32 summed log-probabilities (with grad through the model unless called under
        `torch.inference_mode()`) and (N,) long counts of scored tokens, on the model's device.
        A row with nothing to score gets 0 and 0.
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
    picked = token_logprobs(logits, targets[:, first:].clamp(min=0))  # (N, T-1-first)
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
