"""Token-level information under the language model: per token, the surprisal of the actual
token (-log2 p, bits) and the entropy of the model's predictive distribution (bits); per sample
and per source, token-weighted means. High surprisal is information the model does not have yet
(or noise); the paper's trigram estimate of this, measured on the model being trained.

Knows nothing about valuation: it takes token ids and returns numbers.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from transformers import PreTrainedModel

from leantrain.data.features import padded

LN2 = math.log(2.0)


@dataclass(frozen=True)
class TokenStats:
    """One sample: surprisal and predictive entropy of each predicted token (bits)."""

    surprisal: np.ndarray  # (tokens,)
    entropy: np.ndarray  # (tokens,)

    @property
    def tokens(self) -> int:
        return len(self.surprisal)

    @property
    def mean_surprisal(self) -> float:
        """Information density: bits per token (NaN for a one-token sample: nothing predicted)."""
        return float(self.surprisal.mean()) if self.tokens else math.nan

    @property
    def mean_entropy(self) -> float:
        return float(self.entropy.mean()) if self.tokens else math.nan


@torch.inference_mode()
def token_stats(
    model: PreTrainedModel,
    seqs: Sequence[Sequence[int]],
    pad_id: int,
    batch_size: int = 16,
    on_batch: Callable[[int], None] | None = None,
) -> list[TokenStats]:
    """Surprisal and entropy of tokens 2..T of each sequence, batched with right padding (which
    a causal model needs no mask for: pads come after every real token)."""
    device = next(model.parameters()).device
    out: list[TokenStats] = []
    for start in range(0, len(seqs), batch_size):
        chunk = seqs[start : start + batch_size]
        ids, _ = padded(chunk, pad_id)
        logits = model(input_ids=ids.to(device), use_cache=False).logits[:, :-1].float()
        logp = torch.log_softmax(logits, dim=-1)  # (B, T-1, V): prediction of token t+1
        target = ids[:, 1:].to(device)
        surprisal = -logp.gather(-1, target[..., None])[..., 0] / LN2  # (B, T-1)
        entropy = -(logp.exp() * logp).sum(-1) / LN2  # (B, T-1)
        for row, seq in enumerate(chunk):
            n = max(len(seq) - 1, 0)
            out.append(TokenStats(surprisal[row, :n].cpu().numpy(), entropy[row, :n].cpu().numpy()))
        if on_batch is not None:
            on_batch(len(chunk))
    return out


def per_source(stats: Sequence[TokenStats], sources: Sequence[str]) -> dict[str, dict[str, float]]:
    """Token-weighted mean surprisal and entropy, total bits and counts, per source."""
    groups: dict[str, list[TokenStats]] = defaultdict(list)
    for s, source in zip(stats, sources, strict=True):
        groups[source].append(s)
    summary = {}
    for source, members in sorted(groups.items()):
        surprisal = np.concatenate([m.surprisal for m in members])
        entropy = np.concatenate([m.entropy for m in members])
        summary[source] = {
            "rows": len(members),
            "tokens": len(surprisal),
            "mean_surprisal_bits": float(surprisal.mean()) if len(surprisal) else math.nan,
            "mean_entropy_bits": float(entropy.mean()) if len(entropy) else math.nan,
            "total_bits": float(surprisal.sum()),
        }
    return summary
