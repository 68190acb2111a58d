"""Prices from valuation scores.

Each scoring method m (a Shapley estimate, TracIn, information density...) gives sample i a
score on its own scale; its percentile rank q_m(i) = rank / n in (0, 1] (ties share the average
rank; higher score, higher rank) puts every method on one scale without letting one outlier set
it. With weights w_m from the config:

    utility(i) = sum_m w_m q_m(i) / sum_m w_m          (methods that did not run are left out)
    price(i)   = floor + (budget - n * floor) * utility(i) / sum_j utility(j)

so every sample costs at least `floor`, the prices sum to exactly `budget`, and the rest of the
budget is shared in proportion to utility. A source's price is the sum over its samples.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from scipy.stats import rankdata

from leantrain.errors import LeantrainError


@dataclass(frozen=True)
class Prices:
    utility: np.ndarray  # (n,) in (0, 1]
    price: np.ndarray  # (n,), sums to the budget
    by_source: dict[str, dict[str, float]]


def percentile_ranks(scores: np.ndarray) -> np.ndarray:
    """rank / n with average ranks for ties: (0, 1], the highest score gets 1."""
    return rankdata(np.asarray(scores, dtype=float), method="average") / len(scores)


def price(
    scores: Mapping[str, np.ndarray],
    weights: Mapping[str, float],
    sources: Sequence[str],
    budget: float,
    floor: float = 0.0,
) -> Prices:
    """Prices of n samples from their `scores` per method (each (n,), higher = more valuable);
    methods with no weight, or weight 0, do not count. See the module docstring for the formula."""
    n = len(sources)
    used = {m: w for m, w in weights.items() if m in scores and w > 0}
    if any(w < 0 for w in weights.values()):
        raise LeantrainError(f"pricing weights must be >= 0, got {dict(weights)}")
    if not used:
        raise LeantrainError(
            f"pricing: no weighted method has scores (weights {dict(weights)}, "
            f"scores for {sorted(scores)})"
        )
    if n == 0 or budget < n * floor or floor < 0:
        raise LeantrainError(f"pricing: need 0 <= floor and budget >= n * floor ({n} samples)")
    for m in used:
        if len(scores[m]) != n or not np.all(np.isfinite(scores[m])):
            raise LeantrainError(f"pricing: scores of {m!r} must be {n} finite numbers")
    total_weight = sum(used.values())
    utility = sum(w * percentile_ranks(scores[m]) for m, w in used.items()) / total_weight
    prices = floor + (budget - n * floor) * utility / utility.sum()
    groups: dict[str, list[int]] = defaultdict(list)
    for i, source in enumerate(sources):
        groups[source].append(i)
    by_source = {
        source: {
            "rows": len(idx),
            "price": float(prices[idx].sum()),
            "mean_utility": float(utility[idx].mean()),
        }
        for source, idx in sorted(groups.items())
    }
    return Prices(utility, prices, by_source)
