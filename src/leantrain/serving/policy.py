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
- `budgeted` (`BudgetedPolicy`): the same evidence, but delta bounds the error rate over all
  requests rather than each request's: the requests the evidence trusts most are served first,
  riskier ones with what is left of the budget (see the class for its guarantee).

Where ours differs from vCache (which fits a logistic curve sigma(gamma (s - t)) per entry and
needs its threshold's variance): P(correct | s) is only assumed to grow with similarity s, so every
verdict an entry got at a similarity <= s is evidence for s (a Beta-binomial posterior, exact on
few observations where a logistic fit on separable data has no finite estimate). And, after the
continuous-space cache of arXiv 2604.20021 where feedback spreads to nearby queries, verdicts other
entries got at similarities in [s - window, s] count too, down-weighted (`share_weight`): a new
entry starts from what the whole cache learned about requests that close, not from nothing.

Warm start (optional): verdicts from a labelled calibration stream (`Verdicts`, collected by
`leantrain.serving.cache.calibration_verdicts` on questions the live cache will not see) count as
shared evidence too, so the policy does not have to buy its first few hundred verdicts by
exploring live traffic. vCache starts cold; the bound and the exploration rule are unchanged.

Why not vCache's per-entry logistic fit: on our labelled set (`benchmarks/semantic_cache.py`), the
right/wrong boundary is a step (near-identical texts at >= 0.995 are right 97.5-100% of the time,
paraphrases and hard negatives at 0.9-0.995 84-94%), which a per-entry logistic cannot learn
before its entry has seen several verdicts, and most entries never see that many (figures in
docs/benchmarks.md, "Semantic cache").

Knows nothing about storage or embeddings: evidence arrives as counts.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

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


@runtime_checkable
class StatefulPolicy(HitPolicy, Protocol):
    """A policy whose decisions depend on its past ones (`BudgetedPolicy`): its state outlives
    the process in the cache's file."""

    def state(self) -> dict: ...

    def restore(self, state: dict) -> bool: ...


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
class ExplorePolicy:
    """Never serves a cached answer: every request goes to the backend and its answer is compared
    with the nearest entry's, a verdict (how calibration verdicts are collected)."""

    name: str = "explore"
    window: float | None = None

    def decide(self, similarity: float, evidence: Evidence, rng: random.Random) -> Decision:
        return Decision(hit=False, explore_probability=1.0)


class Verdicts:
    """Labelled (similarity, was the nearest entry's answer right) pairs, e.g. from a calibration
    stream, indexed by similarity so that counting those in a similarity window is O(log n)."""

    def __init__(self, similarities: np.ndarray, correct: np.ndarray) -> None:
        similarities = np.asarray(similarities, dtype=np.float64)
        correct = np.asarray(correct, dtype=bool)
        if similarities.shape != correct.shape or similarities.ndim != 1:
            raise LeantrainError(
                f"verdicts need one similarity per verdict, got {similarities.shape} "
                f"similarities and {correct.shape} verdicts"
            )
        order = np.argsort(similarities, kind="stable")
        self.similarities = similarities[order]  # (n,) ascending
        self._right_before = np.concatenate([[0], np.cumsum(correct[order])])  # (n + 1,)

    def __len__(self) -> int:
        return len(self.similarities)

    @property
    def right(self) -> int:
        """How many of the verdicts say the nearest entry's answer was right."""
        return int(self._right_before[-1])

    def count(self, low: float, high: float) -> tuple[int, int]:
        """(right, seen) among the verdicts with low <= similarity <= high."""
        first = int(np.searchsorted(self.similarities, low, side="left"))
        last = int(np.searchsorted(self.similarities, high, side="right"))
        return int(self._right_before[last] - self._right_before[first]), last - first


# float32 inner products of unit vectors wobble by ~1e-7 (as in the store's evidence windows).
_FLOAT_SLACK = 1e-6


@dataclass(frozen=True)
class VerifiedPolicy:
    """Per-entry learned hit prediction under an error bound (see the module doc).

    Attributes:
        delta: the bound on the rate of wrong cached answers, per request.
        share_weight: weight of one observation of another entry (in the similarity window)
            against one of the entry's own; 0 learns from the entry's own observations only.
        window: width of the similarity window below the request's similarity from which other
            entries' (and the prior's) verdicts are shared. Narrow: less bias where P(correct)
            jumps with similarity, fewer verdicts. The default was chosen on the calibration split
            of `leantrain.serving.evalset` (validation stream of other questions), not on the
            evaluation stream.
        min_verdicts: below this much (weighted) evidence, always explore (vCache: 6).
        prior: verdicts from a labelled calibration stream (warm start), or None (cold, vCache).
        prior_weight: weight of one prior verdict against one of the entry's own.
    """

    delta: float = 0.02
    share_weight: float = 1.0
    window: float = 0.003
    min_verdicts: float = 6.0
    prior: Verdicts | None = field(default=None, repr=False, compare=False)
    prior_weight: float = 1.0
    name: str = "verified"

    def __post_init__(self) -> None:
        _check_settings(self)

    def decide(self, similarity: float, evidence: Evidence, rng: random.Random) -> Decision:
        right, seen = pooled_verdicts(self, similarity, evidence)
        tau = 1.0 if seen < self.min_verdicts else explore_probability(right, seen, self.delta)
        predicted = (1 + right) / (2 + seen)  # posterior mean of P(correct)
        return Decision(rng.random() >= tau, tau, predicted)


class _Pooling(Protocol):
    delta: float
    share_weight: float
    window: float
    prior: Verdicts | None
    prior_weight: float


def _check_settings(pooling: _Pooling) -> None:
    """Refuse a delta, weight or window a policy cannot use, naming it."""
    if not 0.0 < pooling.delta < 1.0:
        raise LeantrainError(f"delta must be in (0, 1), got {pooling.delta}")
    if not 0.0 <= pooling.share_weight <= 1.0 or pooling.window < 0:
        raise LeantrainError("share_weight must be in [0, 1] and window >= 0")
    if not 0.0 <= pooling.prior_weight <= 1.0:
        raise LeantrainError(f"prior_weight must be in [0, 1], got {pooling.prior_weight}")


def pooled_verdicts(
    pooling: _Pooling, similarity: float, evidence: Evidence
) -> tuple[float, float]:
    """(right, seen), weighted: the entry's own verdicts, other entries' in the window and the
    prior's in the window (see `VerifiedPolicy`'s attributes for the weights)."""
    right = evidence.own_right + pooling.share_weight * evidence.shared_right
    seen = evidence.own_seen + pooling.share_weight * evidence.shared_seen
    if pooling.prior is not None:
        low, high = similarity - pooling.window - _FLOAT_SLACK, similarity + _FLOAT_SLACK
        prior_right, prior_seen = pooling.prior.count(low, high)
        right += pooling.prior_weight * prior_right
        seen += pooling.prior_weight * prior_seen
    return right, seen


@dataclass
class BudgetedPolicy:
    """Spends delta as a budget on the aggregate error rate instead of per request.

    Evidence is pooled as in `VerifiedPolicy` (same attributes, same Beta(1, 1) posterior), and
    each request's risk u = posterior mean of P(wrong) = 1 - (1 + right) / (2 + seen) is what
    serving it costs. After k requests (those with a nearest entry), two rules decide:

    - never overspend: serve only if the risk spent so far plus u stays within the budget
      delta * k - z * sqrt(delta * k);
    - least risky first (water-filling over the k risks seen so far, summed in bins 0.001
      wide): serve a request whose bin, with every less risky bin, would have cost at most
      delta per request; never one past that; in the bin where delta is reached, serve with the
      probability that spends what is left. Requests the evidence trusts most take the budget,
      riskier ones only what remains.

    The guarantee, under the same model as `VerifiedPolicy` (each request's posterior is right:
    the pooled and calibration verdicts in its window are representative of it): the expected
    number of wrong answers served after k requests is at most the risk spent, which is at most
    delta * k - z * sqrt(delta * k). The count minus the risk spent is a martingale whose
    conditional variance is at most the risk spent, so by Freedman's inequality the count exceeds
    delta * k with probability at most exp(-z**2 / (2 (1 + z / (3 sqrt(delta * k))))), about
    exp(-z**2 / 2) = 0.26 for z = 1.645, and about Phi(-z) = 5% by the normal approximation, at
    each k. vCache bounds each request's error probability by delta instead, which costs hits
    wherever the evidence is unsure, even while the budget is unused.

    It does not explore at random: requests it does not serve are misses whose verdicts feed
    the pooled evidence; the requests it always serves get no fresh verdicts, so a prior that is
    wrong where it is most confident is corrected only by feedback. Its state (risk spent,
    requests seen, risks per bin) goes out as `state()` and comes back with `restore()`:
    `SemanticCache` keeps it in the cache's file after every decision, so a restarted server
    goes on with the budget it had (a fresh one would be safe too, only more cautious).

    Attributes:
        delta: the bound on the rate of wrong cached answers, over all requests.
        z: slack of the budget in standard deviations of the wrong-answer count (see above).
        share_weight, window, prior, prior_weight: the evidence, as in `VerifiedPolicy`.
    """

    delta: float = 0.02
    z: float = 1.645
    share_weight: float = 1.0
    window: float = 0.003
    prior: Verdicts | None = field(default=None, repr=False)
    prior_weight: float = 1.0
    name: str = "budgeted"
    requests: int = field(default=0, init=False)
    spent: float = field(default=0.0, init=False)
    _risk_sums: np.ndarray = field(init=False, repr=False)  # (bins,) sum of past risks per bin

    def __post_init__(self) -> None:
        _check_settings(self)
        if self.z < 0:
            raise LeantrainError(f"z must be >= 0, got {self.z}")
        self._risk_sums = np.zeros(_RISK_BIN_COUNT)

    def decide(self, similarity: float, evidence: Evidence, rng: random.Random) -> Decision:
        right, seen = pooled_verdicts(self, similarity, evidence)
        predicted = (1 + right) / (2 + seen)
        risk = 1 - predicted  # posterior mean of P(wrong)
        self.requests += 1
        risk_bin = min(int(risk * _RISK_BIN_COUNT), _RISK_BIN_COUNT - 1)
        self._risk_sums[risk_bin] += risk
        budget = self.delta * self.requests - self.z * np.sqrt(self.delta * self.requests)
        serve_probability = self._serve_probability(risk_bin)
        hit = self.spent + risk <= budget and rng.random() < serve_probability
        if hit:
            self.spent += risk
        return Decision(hit, 1.0 - serve_probability, predicted)

    def state(self) -> dict:
        """What a restart needs to go on with this budget: the settings it was spent under,
        the requests seen, the risk spent and the risks per bin (sparse: {bin: sum})."""
        used = np.flatnonzero(self._risk_sums)
        return {
            "delta": self.delta,
            "z": self.z,
            "requests": self.requests,
            "spent": self.spent,
            "risk_sums": {str(i): float(self._risk_sums[i]) for i in used},
        }

    def restore(self, state: dict) -> bool:
        """Go on with the budget in `state` (from `state()`) if it was spent under the same
        delta and z; otherwise keep the fresh one. Returns whether it was restored."""
        if (state.get("delta"), state.get("z")) != (self.delta, self.z):
            return False
        self.requests, self.spent = int(state["requests"]), float(state["spent"])
        self._risk_sums = np.zeros(_RISK_BIN_COUNT)
        for risk_bin, total in state["risk_sums"].items():
            self._risk_sums[int(risk_bin)] = total
        return True

    def _serve_probability(self, risk_bin: int) -> float:
        """Water-filling over the past risks: 1 for a bin that, with every less risky one,
        would have cost at most delta per request; 0 past that; the bin where delta is reached
        gets the share that is left."""
        cost = self._risk_sums / self.requests  # (bins,) risk per request so far
        before = float(cost[:risk_bin].sum())  # spent on less risky bins, per request
        if cost[risk_bin] == 0:  # risk 0 costs nothing
            return 1.0
        return float(np.clip((self.delta - before) / cost[risk_bin], 0.0, 1.0))


_RISK_BIN_COUNT = 1000  # past risks are summed in bins 0.001 wide


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
    """`threshold`, `verified` or `budgeted`, by name."""
    policies = {
        "threshold": lambda: ThresholdPolicy(threshold),
        "verified": lambda: VerifiedPolicy(delta),
        "budgeted": lambda: BudgetedPolicy(delta),
    }
    if name not in policies:
        raise LeantrainError(f"policy must be one of {sorted(policies)}, got {name!r}")
    return policies[name]()
