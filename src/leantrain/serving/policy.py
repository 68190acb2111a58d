"""Hit policies of the semantic cache: given the nearest cached entry, its similarity to the new
request and the evidence about that entry so far, serve the cached answer or not.

- `threshold` (GPTCache's rule, the baseline): hit when similarity >= a fixed threshold.
- `verified` (after vCache, arXiv 2502.03771, implemented from the paper): every entry learns its
  own "is the cached answer right at this similarity" from the verdicts of past explorations and
  feedback. The policy explores (asks the backend, compares, learns) with probability tau and
  serves the cached answer otherwise, with tau just large enough that
  P(served answer wrong) = (1 - tau) * (1 - alpha) stays under the user's bound delta, alpha
  being a lower confidence bound of P(correct): tau = min over eps of 1 - delta / (1 - alpha_eps),
  alpha_eps = (1 - eps) * (the eps lower quantile of P(correct)); vCache's rule.

Where ours differs from vCache (which fits a logistic curve per entry and needs its threshold's
variance): P(correct | s) is only assumed to grow with similarity s, so every verdict an entry got
at a similarity <= s is evidence for s (a Beta-binomial posterior, exact on few observations where
a logistic fit on separable data has no finite estimate). And, after the continuous-space cache
of arXiv 2604.20021 where feedback spreads to nearby queries, verdicts other entries got at
similarities just below s count too, down-weighted (`share_weight`): a new entry starts from
what the whole cache learned about requests that close, not from nothing.

Knows nothing about storage or embeddings: evidence arrives as counts.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Protocol

import numpy as np
from scipy.stats import beta

from leantrain.errors import LeantrainError


@dataclass(frozen=True)
class Evidence:
    """Verdicts relevant to serving one entry at similarity s: the entry's own at similarities
    <= s, and other entries' at similarities in [s - window, s]."""

    own_right: int = 0
    own_seen: int = 0
    shared_right: int = 0
    shared_seen: int = 0


@dataclass(frozen=True)
class Decision:
    """What to do with one request. `predicted_correct`: the policy's estimate that the cached
    answer is right (None if it has none), the basis of the server's error estimate."""

    hit: bool
    explore_probability: float
    predicted_correct: float | None = None


class HitPolicy(Protocol):
    name: str
    window: float | None  # similarity window of shared evidence; None: needs no evidence

    def decide(self, similarity: float, evidence: Evidence, rng: random.Random) -> Decision:
        """Serve the nearest entry, found at `similarity`?"""
        ...


@dataclass(frozen=True)
class ThresholdPolicy:
    """Hit when the similarity reaches a fixed threshold; never explores."""

    threshold: float = 0.9
    name: str = "threshold"
    window: float | None = None

    def __post_init__(self) -> None:
        if not -1.0 <= self.threshold <= 1.0:
            raise LeantrainError(f"threshold must be in [-1, 1], got {self.threshold}")

    def decide(self, similarity: float, evidence: Evidence, rng: random.Random) -> Decision:
        return Decision(hit=similarity >= self.threshold, explore_probability=0.0)


@dataclass(frozen=True)
class VerifiedPolicy:
    """Per-entry learned hit prediction under an error bound (see the module doc).

    Attributes:
        delta: the bound on the rate of wrong cached answers, per request.
        share_weight: weight of one observation of another entry (in the similarity window)
            against one of the entry's own; 0 learns from the entry's own observations only.
        window: width of the similarity window below the request's similarity from which other
            entries' observations are shared.
        min_verdicts: below this much (weighted) evidence, always explore (vCache: 6).
    """

    delta: float = 0.02
    share_weight: float = 1.0
    window: float = 0.005
    min_verdicts: float = 6.0
    name: str = "verified"

    def __post_init__(self) -> None:
        if not 0.0 < self.delta < 1.0:
            raise LeantrainError(f"delta must be in (0, 1), got {self.delta}")
        if not 0.0 <= self.share_weight <= 1.0 or self.window < 0:
            raise LeantrainError("share_weight must be in [0, 1] and window >= 0")

    def decide(self, similarity: float, evidence: Evidence, rng: random.Random) -> Decision:
        right = evidence.own_right + self.share_weight * evidence.shared_right
        seen = evidence.own_seen + self.share_weight * evidence.shared_seen
        tau = 1.0 if seen < self.min_verdicts else explore_probability(right, seen, self.delta)
        predicted = (1 + right) / (2 + seen)  # posterior mean of P(correct)
        return Decision(rng.random() >= tau, tau, predicted)


# Confidence levels the policy tries; the least exploration among them wins.
_EPSILONS = np.linspace(0.001, 0.5, 200)


def explore_probability(right: float, seen: float, delta: float) -> float:
    """tau = min over eps of 1 - delta / (1 - alpha_eps), alpha_eps = (1 - eps) times the eps
    quantile of the Beta(1 + right, 1 + seen - right) posterior of P(correct), clipped to [0, 1]."""
    lower = beta.ppf(_EPSILONS, 1 + right, 1 + seen - right)  # (E,)
    alpha = (1 - _EPSILONS) * lower
    tau = 1 - delta / np.maximum(1 - alpha, 1e-12)
    return float(np.clip(tau.min(), 0.0, 1.0))


def make_policy(name: str, *, threshold: float = 0.9, delta: float = 0.02) -> HitPolicy:
    """`threshold` or `verified`, by name."""
    policies = {
        "threshold": lambda: ThresholdPolicy(threshold),
        "verified": lambda: VerifiedPolicy(delta),
    }
    if name not in policies:
        raise LeantrainError(f"policy must be one of {sorted(policies)}, got {name!r}")
    return policies[name]()
