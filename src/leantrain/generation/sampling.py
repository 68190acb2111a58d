"""The per-step sampler: temperature, top-k, top-p, greedy (the parameters: `SamplingParams`,
generation/config.py).

The logprob returned for each sampled token is the behaviour logprob the trainer recomputes:
`log_softmax(logits / temperature)` of that token (temperature 1 when greedy), taken BEFORE
top-k/top-p filtering, so it never depends on the truncation and is never -inf.
"""

from __future__ import annotations

import math

import torch

from leantrain.generation.config import SamplingParams


def sample(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None = None,
    ranks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row.

    Args:
        logits: next-token logits, (B, V), any float dtype.
        params: temperature, top-k, top-p (greedy when temperature == 0).
        generator: random source for sampling, on the logits' device; unused when greedy.
        ranks: (B,) row i takes the ranks[i]-th of the B uniform draws (default: the i-th), so
            the rows' order in memory need not decide which random number each one gets.

    Returns:
        tokens (B,) int64 and their logprobs (B,) float32: `log_softmax(logits / temperature)` of
        the sampled token before top-k/top-p filtering (temperature 1 when greedy).
    """
    if params.greedy or (params.top_k == 0 and params.top_p >= 1):
        return _sample_plain(logits, params, generator, ranks)
    probs, logp = sampling_distribution(logits, params)
    tokens = inverse_cdf(probs, generator, ranks)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


def _sample_plain(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
    ranks: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample` without top-k/top-p: one fp32 copy of the logits, worked on in place.

    At batch 64 over a 49k vocabulary every (B, V) fp32 temporary costs about a millisecond
    (fresh pages), as much as the arithmetic; so z - max is exponentiated in place, and its
    sum (greedy) or running sum (the CDF to draw from) gives the normaliser of the logprob:
    logprob = z_token - max - log(sum exp(z - max)), z = logits / temperature.
    """
    temperature = 1.0 if params.greedy else params.temperature
    z = logits.to(torch.float32, copy=True)  # (B, V); copied, since it is changed in place
    if temperature != 1.0:
        z.div_(temperature)
    if params.greedy:
        top, tokens = z.max(-1)  # the first of tied maxima, as argmax
        return tokens, -z.sub_(top[:, None]).exp_().sum(-1).log()
    top = z.amax(-1)
    cdf = z.sub_(top[:, None]).exp_().cumsum_(-1)
    tokens = _draw(cdf, generator, ranks)
    # z_token recomputed from the logits: the same fp32 value z held before it was shifted.
    picked = logits.gather(-1, tokens[:, None]).squeeze(-1).float() / temperature
    return tokens, picked - top - cdf[:, -1].log()


def sampling_distribution(
    logits: torch.Tensor, params: SamplingParams
) -> tuple[torch.Tensor, torch.Tensor]:
    """The distribution `sample` draws from, and the behaviour logprobs it reports.

    Args:
        logits: (..., V) next-token logits.

    Returns:
        probs (..., V) fp32: after temperature, top-k and top-p (one-hot on the argmax when
        greedy); logp (..., V) fp32: `log_softmax(logits / temperature)` before filtering
        (temperature 1 when greedy). Speculative decoding verifies drafts against `probs`.
    """
    logits = logits.float()
    if params.greedy:
        logp = logits.log_softmax(-1)
        probs = torch.zeros_like(logp).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
        return probs, logp
    logp = (logits / params.temperature).log_softmax(-1)  # the behaviour distribution
    kept = logp
    if 0 < params.top_k < logp.shape[-1]:
        kth = logp.topk(params.top_k, dim=-1).values[..., -1:]
        kept = kept.masked_fill(kept < kth, -math.inf)
    if params.top_p < 1:
        # Sort descending and drop a token once the mass strictly before it reaches top_p; the
        # top token always survives. Mass is that of the top-k-renormalised distribution (as HF).
        probs, order = kept.softmax(-1).sort(-1, descending=True)
        drop_sorted = probs.cumsum(-1) - probs >= params.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)  # back to vocabulary order
        kept = kept.masked_fill(drop, -math.inf)
    return kept.softmax(-1), logp


def inverse_cdf(
    probs: torch.Tensor, generator: torch.Generator | None, ranks: torch.Tensor | None = None
) -> torch.Tensor:
    """One draw per row of (B, V) `probs` (need not sum to 1): the first token whose cumulative
    mass exceeds a uniform draw scaled to the row's total.

    Zero-probability tokens add no step to the CDF, so they are never hit. Needs one random
    number per row, where `torch.multinomial` (and the exponential race) draw
    per vocabulary entry: 10-20x faster on CPU, where random numbers are slow.
    """
    return _draw(probs.cumsum(-1), generator, ranks)


def _draw(
    cdf: torch.Tensor, generator: torch.Generator | None, ranks: torch.Tensor | None
) -> torch.Tensor:
    """Invert (B, V) cumulative mass `cdf` at one uniform draw per row scaled to its total
    (row i takes draw ranks[i] when given)."""
    u = torch.rand(cdf.shape[0], 1, generator=generator, device=cdf.device)
    u = (u if ranks is None else u[ranks.to(u.device)]) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).clamp_(max=cdf.shape[-1] - 1).squeeze(-1)
