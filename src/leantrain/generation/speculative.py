"""Speculative decoding, the engine's side (TLT, arXiv 2511.16665): when few sequences are still
decoding, the hardware is memory-bound and a forward over k+1 tokens costs little more than over
one, so a cheap drafter proposes k tokens per row and one target forward verifies them all.

Lossless for any temperature (and token-for-token identical when greedy): draft token d with
draft probability q(d) is accepted with probability min(1, p(d) / q(d)), where p is exactly the
distribution `sample` draws from (temperature, top-k, top-p applied); at the first rejection the
replacement is drawn from normalize(max(p - q, 0)); when every draft is accepted the next token is
drawn from p at the position after them (Leviathan et al. 2023, Chen et al. 2023). A deterministic
drafter (the suffix drafter, or any drafter when greedy) has q one-hot on its token.

The engine calls a `Speculator`: it says at each step whether to speculate and how far, drafts,
and hears what the step produced. When to speculate, with which drafter, and the drafters
themselves live in leantrain.speculation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from leantrain.generation.config import SamplingParams
from leantrain.generation.sampling import inverse_cdf, sampling_distribution


class SeqView(Protocol):
    """What a speculator and its drafters may read of a decoding sequence."""

    prompt_ids: list[int]
    response_ids: list[int]


@dataclass
class Draft:
    """Proposed continuations, one row per live sequence.

    Attributes:
        tokens: (B, k) draft tokens; entries past a row's length are ignored.
        lengths: (B,) valid drafts per row, 0..k (a suffix drafter may find nothing).
        probs: (B, k, V) the distribution each draft token was sampled from; None when every
            draft is deterministic (q one-hot on the token).
    """

    tokens: torch.Tensor
    lengths: torch.Tensor
    probs: torch.Tensor | None = None

    def to(self, device: torch.device) -> Draft:
        """The same draft on `device`, cut to its longest row (no column nobody drafted is
        verified; a draft with nothing in it becomes a plain one-token step)."""
        k = int(self.lengths.max()) if len(self.lengths) else 0
        probs = None if self.probs is None else self.probs[:, :k].to(device)
        return Draft(self.tokens[:, :k].to(device), self.lengths.to(device), probs)


@dataclass
class Verdict:
    """Result of verifying a draft against the target's logits.

    Attributes:
        accepted: (B,) accepted draft tokens per row.
        accepted_logprobs: (B, k) behaviour logprob of each draft token (valid up to accepted).
        next_logits: (B, V) target logits after the accepted prefix: the next token is sampled
            from them, unless `forced` holds one.
        forced: (B,) the replacement drawn from the residual at a rejection, -1 where none.
        forced_logprobs: (B,) behaviour logprobs of the forced tokens.
    """

    accepted: torch.Tensor
    accepted_logprobs: torch.Tensor
    next_logits: torch.Tensor
    forced: torch.Tensor
    forced_logprobs: torch.Tensor


def verify(
    logits: torch.Tensor, draft: Draft, params: SamplingParams, generator: torch.Generator
) -> Verdict:
    """Speculative sampling's accept/reject rule for a batch.

    Args:
        logits: (B, k+1, V) target logits at the fed [last token, d_1..d_k]: position j
            predicts the token after d_j (after the last token for j = 0).
        draft: the k drafts per row and their draft distribution.
    """
    batch, k = draft.tokens.shape
    rows = torch.arange(batch, device=logits.device)
    probs, logp = sampling_distribution(logits, params)  # (B, k+1, V) each
    d = draft.tokens[..., None]  # (B, k, 1)
    p_d = probs[:, :k].gather(-1, d).squeeze(-1)  # (B, k)
    q_d = torch.ones_like(p_d) if draft.probs is None else draft.probs.gather(-1, d).squeeze(-1)
    u = torch.rand(p_d.shape, generator=generator, device=p_d.device)
    valid = torch.arange(k, device=p_d.device) < draft.lengths[:, None]
    ok = (u * q_d < p_d) & valid  # accept with probability min(1, p/q)
    accepted = ok.long().cumprod(-1).sum(-1)  # (B,) leading run of acceptances
    rejected = accepted < draft.lengths
    p_next = probs[rows, accepted]  # (B, V) the target at the first unaccepted position
    forced = torch.full_like(accepted, -1)
    if bool(rejected.any()):
        at = accepted.clamp(max=k - 1)
        if draft.probs is None:
            q_next = torch.zeros_like(p_next).scatter_(-1, draft.tokens[rows, at][:, None], 1.0)
        else:
            q_next = draft.probs[rows, at]
        residual = (p_next - q_next).clamp(min=0)
        # p == q (up to rounding) would leave no residual mass; then p itself is the answer.
        residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_next)
        forced = torch.where(rejected, inverse_cdf(residual, generator), forced)
    logp_next = logp[rows, accepted]  # (B, V)
    return Verdict(
        accepted=accepted,
        accepted_logprobs=logp[:, :k].gather(-1, d).squeeze(-1),
        next_logits=logits[rows, accepted],
        forced=forced,
        forced_logprobs=logp_next.gather(-1, forced.clamp(min=0)[:, None]).squeeze(-1),
    )


class Speculator(Protocol):
    """What the engine calls at each decoding step (the long-tail speculator of
    leantrain.speculation, or any other policy): `choose` opens a step, `propose` drafts for it
    when it speculates, `record` closes it with what it produced."""

    @property
    def needs_hidden(self) -> bool:
        """Whether `propose` reads the target's hidden states (the engine then captures them)."""
        ...

    def begin(self, seqs: Sequence[SeqView]) -> None:
        """A `generate` call starts with these sequences (all of it, queued ones too)."""
        ...

    def end(self) -> None:
        """The `generate` call finished."""
        ...

    def choose(self, live: int, queued: int) -> int | None:
        """The draft length k for this step with `live` decoding and `queued` waiting sequences:
        None for a plain step left untimed, 0 for a plain step reported with `record`."""
        ...

    def propose(
        self,
        seqs: Sequence[SeqView],
        hidden: torch.Tensor | None,
        params: SamplingParams,
        generator: torch.Generator,
    ) -> Draft:
        """Up to the chosen k draft tokens after each live sequence's last token; `hidden`
        (B, H) is the target's hidden state that sampled that token (None unless
        `needs_hidden`)."""
        ...

    def record(self, emitted: int, accepted: int = 0, drafted: int = 0, rows: int = 0) -> None:
        """Close the step `choose` opened: `emitted` tokens were produced by it, of them
        `accepted` from `drafted` draft tokens over `rows` verified rows."""
        ...
