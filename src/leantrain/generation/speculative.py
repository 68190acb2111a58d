"""Speculative decoding for the long tail (TLT, arXiv 2511.16665): when few sequences are still
decoding, the hardware is memory-bound and a forward over k+1 tokens costs little more than over
one, so a cheap drafter proposes k tokens per row and one target forward verifies them all.

Lossless for any temperature (and token-for-token identical when greedy): draft token d with
draft probability q(d) is accepted with probability min(1, p(d) / q(d)), where p is exactly the
distribution `sample` draws from (temperature, top-k, top-p applied); at the first rejection the
replacement is drawn from normalize(max(p - q, 0)); when every draft is accepted the next token is
drawn from p at the position after them (Leviathan et al. 2023, Chen et al. 2023). A deterministic
drafter (the suffix drafter, or any drafter when greedy) has q one-hot on its token.

Speculation switches on only when the live sequences are at most `threshold` (the long tail); a
bucketed epsilon-greedy bandit (TLT's BEG-MAB) picks the drafter and draft length per step from
the accepted tokens per second each arm delivered at that batch size.

The engine calls `Speculator`; it knows nothing about drafters beyond the `Drafter` protocol.
"""

from __future__ import annotations

import time
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from leantrain.errors import LeantrainError
from leantrain.generation.bandit import Arm, BucketedEpsilonGreedy
from leantrain.generation.config import SamplingParams
from leantrain.generation.sampling import inverse_cdf, sampling_distribution
from leantrain.speculation.config import DrafterType, SpeculativeConfig

DRAFTER_TYPES = typing.get_args(DrafterType)


class SeqView(Protocol):
    """What a drafter may read of a decoding sequence."""

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


class Drafter(Protocol):
    """A source of drafts. `needs_hidden`: `propose` reads the target's last hidden state."""

    needs_hidden: bool

    def begin(self, seqs: Sequence[SeqView]) -> None:
        """A `generate` call starts with these sequences (all of it, queued ones too)."""

    def propose(
        self,
        seqs: Sequence[SeqView],
        hidden: torch.Tensor | None,
        k: int,
        params: SamplingParams,
        generator: torch.Generator,
    ) -> Draft:
        """Draft up to k tokens after each live sequence's last token; `hidden` (B, H) is the
        target's hidden state that sampled that token."""

    def end(self) -> None:
        """The `generate` call finished."""


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


@dataclass
class SpecStats:
    """What speculation did during one `generate` call (the per-step RL metrics).

    Attributes:
        tokens: response tokens generated in all.
        drafted: draft tokens proposed; accepted: those accepted.
        verify_rows: row-steps that verified a draft (each yields accepted + 1 tokens).
        tail_s: seconds from the first step with an empty queue and at most `threshold` live
            sequences to the end (the long tail), whether or not speculation was enabled; 0 if
            the call never got there (e.g. many rows ran to max_new_tokens together).
        tail_tokens: response tokens generated in the tail.
        arms: times each arm was chosen.
    """

    tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    verify_rows: int = 0
    tail_s: float = 0.0
    tail_tokens: int = 0
    arms: dict[str, int] = field(default_factory=dict)

    @property
    def mean_accept_len(self) -> float:
        """Tokens per verified row-step: accepted drafts + 1 (TLT's accept length); 0 if none."""
        return (self.accepted + self.verify_rows) / self.verify_rows if self.verify_rows else 0.0

    @property
    def drafted_fraction(self) -> float:
        """Share of the generated tokens that came from accepted drafts."""
        return self.accepted / self.tokens if self.tokens else 0.0

    def as_metrics(self) -> dict[str, float]:
        """Flat per-step metrics for metrics.jsonl."""
        return {
            "spec_accept_len": round(self.mean_accept_len, 4),
            "spec_drafted_fraction": round(self.drafted_fraction, 4),
            "spec_tail_s": round(self.tail_s, 4),
        }


class Speculator:
    """Decides when and how to speculate, and keeps the statistics; the engine does the
    forwards.

    Args:
        config: the `speculative:` settings (its `drafters` list is for `LongTail`, which
            builds the drafters; here the arms are the `drafters` given).
        drafters: drafter instances by name (none needed when `config.enabled` is False: the
            speculator then only times the tail).
        seed: seeds the bandit's exploration.
        on_tail: called with True when the long tail starts and False when the call ends (the
            spot trainer trains in between).
    """

    def __init__(
        self,
        config: SpeculativeConfig,
        drafters: dict[str, Drafter],
        seed: int = 0,
        on_tail: Callable[[bool], None] | None = None,
    ) -> None:
        if config.enabled and not drafters:
            raise LeantrainError("an enabled Speculator needs at least one drafter")
        self.config = config
        self.drafters = drafters
        self.on_tail = on_tail
        arms = [Arm(name, k) for name in drafters for k in config.draft_lengths if k > 0]
        if 0 in config.draft_lengths:
            arms.append(Arm("none", 0))
        # A disabled speculator may have no drafters; its bandit is never asked.
        arms = arms or [Arm("none", 0)]
        self.bandit = BucketedEpsilonGreedy(arms, epsilon=config.epsilon, seed=seed)
        self.stats = SpecStats()
        self._tail_start: float | None = None
        self._seqs: list[SeqView] = []
        self._step: tuple[Arm, int, float] | None = None

    @property
    def needs_hidden(self) -> bool:
        """Whether the engine must capture the target's hidden states for a drafter."""
        return self.config.enabled and any(d.needs_hidden for d in self.drafters.values())

    def begin(self, seqs: Sequence[SeqView]) -> None:
        """A `generate` call starts: fresh statistics; drafters see every sequence."""
        self.stats = SpecStats()
        self._tail_start = None
        self._seqs = list(seqs)
        if self.config.enabled:
            for drafter in self.drafters.values():
                drafter.begin(seqs)

    def end(self) -> None:
        """The `generate` call finished: close the tail timer and the drafters."""
        self.stats.tokens = self._tokens()
        if self._tail_start is not None:
            self.stats.tail_s = time.perf_counter() - self._tail_start
            self.stats.tail_tokens += self.stats.tokens
            if self.on_tail is not None:
                self.on_tail(False)
        self._seqs = []
        if self.config.enabled:
            for drafter in self.drafters.values():
                drafter.end()

    def _tokens(self) -> int:
        """Response tokens of this call's sequences so far."""
        return sum(len(seq.response_ids) for seq in self._seqs)

    def choose(self, live: int, queued: int) -> Arm | None:
        """The arm to play at this step (k = 0: a plain step, timed for the bandit all the
        same), or None outside the long tail (or when disabled). The engine reports the step's
        outcome with `record`."""
        if queued == 0 and live <= self.config.threshold and self._tail_start is None:
            self._tail_start = time.perf_counter()
            self.stats.tail_tokens = -self._tokens()  # the end adds the total
            if self.on_tail is not None:
                self.on_tail(True)
        if not self.config.enabled or live > self.config.threshold:
            return None
        arm = self.bandit.choose(live)
        self._step = (arm, live, time.perf_counter())
        self.stats.arms[arm.label] = self.stats.arms.get(arm.label, 0) + 1
        return arm

    def propose(
        self,
        arm: Arm,
        seqs: Sequence[SeqView],
        hidden: torch.Tensor | None,
        params: SamplingParams,
        generator: torch.Generator,
    ) -> Draft:
        """Draft with the chosen arm."""
        return self.drafters[arm.drafter].propose(seqs, hidden, arm.k, params, generator)

    def record(self, emitted: int, accepted: int = 0, drafted: int = 0, rows: int = 0) -> None:
        """Close the step `choose` opened (if any): `emitted` tokens were produced by it, of them
        `accepted` from `drafted` draft tokens over `rows` verified rows."""
        self.stats.accepted += accepted
        self.stats.drafted += drafted
        self.stats.verify_rows += rows
        if self._step is not None:
            arm, live, start = self._step
            self.bandit.update(live, arm, emitted / max(time.perf_counter() - start, 1e-9))
            self._step = None
