"""Data Shapley and its relatives: what each training sample adds to a utility.

A utility maps a set of training indices to a number (a validation accuracy after retraining on
those samples, a game's payoff). A semivalue averages a sample's marginal contribution
U(S + i) - U(S) over coalitions S, weighting a coalition of size k by p(k):

- Shapley: p(k) = 1/n (every size equally likely).
- Beta(alpha, beta) Shapley (Kwon and Zou, 2022): p(k) = C(n-1, k) B(k + beta, n-1-k + alpha) /
  B(alpha, beta), a beta-binomial; alpha > beta favours small coalitions, where one noisy sample
  moves the utility most. Beta(1, 1) is Shapley.

Estimators: `exact_semivalues` enumerates all 2^n coalitions (small n, and the tests' ground
truth); `permutation_semivalues` samples permutations (each prefix is a uniform coalition of its
size, so a marginal at position k weighted by n p(k) is unbiased), truncates a permutation once
its prefix is within `truncation` of the full utility (TMC-Shapley, Ghorbani and Zou, 2019) and
stops when every value's standard error is small; `leave_one_out`; and `knn_shapley`, the exact
closed form for a K-nearest-neighbour classifier (Jia et al., 2019). Knows nothing about models.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import torch
from scipy.stats import betabinom

from leantrain.errors import LeantrainError

Utility = Callable[[np.ndarray], float]  # sorted training indices -> utility


class CachedUtility:
    """A utility that remembers every coalition it has seen (TMC revisits short prefixes often)
    and counts the distinct evaluations, the cost that matters."""

    def __init__(self, fn: Utility) -> None:
        self.fn = fn
        self.cache: dict[bytes, float] = {}

    def __call__(self, indices: Iterable[int]) -> float:
        key = np.sort(np.fromiter(indices, dtype=np.int64))
        token = key.tobytes()
        if token not in self.cache:
            self.cache[token] = float(self.fn(key))
        return self.cache[token]

    @property
    def evaluations(self) -> int:
        return len(self.cache)


def coalition_size_probs(n: int, alpha: float = 1.0, beta: float = 1.0) -> np.ndarray:
    """p(k) for k = 0..n-1 others in the coalition: uniform for Shapley (alpha = beta = 1),
    beta-binomial(n - 1, beta, alpha) for Beta(alpha, beta) Shapley."""
    if alpha <= 0 or beta <= 0:
        raise LeantrainError(f"Beta-Shapley needs alpha, beta > 0, got ({alpha}, {beta})")
    if alpha == 1.0 and beta == 1.0:
        return np.full(n, 1.0 / n)
    return betabinom(n - 1, beta, alpha).pmf(np.arange(n))


def exact_semivalues(utility: Utility, n: int, alpha: float = 1.0, beta: float = 1.0) -> np.ndarray:
    """Every sample's semivalue by enumerating all 2^n coalitions (n <= 20)."""
    if not 1 <= n <= 20:
        raise LeantrainError(f"exact enumeration is for 1 <= n <= 20 samples, got {n}")
    members = np.arange(n)
    u = np.array(
        [utility(members[[(mask >> i) & 1 == 1 for i in range(n)]]) for mask in range(1 << n)]
    )
    sizes = np.array([bin(mask).count("1") for mask in range(1 << n)])
    # Weight of one coalition S of size k not containing i: p(k) / C(n-1, k).
    per_coalition = coalition_size_probs(n, alpha, beta) / [math.comb(n - 1, k) for k in range(n)]
    values = np.zeros(n)
    for i in range(n):
        without = np.array([mask for mask in range(1 << n) if not (mask >> i) & 1])
        values[i] = np.sum(per_coalition[sizes[without]] * (u[without | (1 << i)] - u[without]))
    return values


@dataclass(frozen=True)
class SemivalueResult:
    """Estimated values, their standard errors, and what the estimate cost."""

    values: np.ndarray
    std_errors: np.ndarray
    permutations: int
    utility_evaluations: int
    converged: bool


def permutation_semivalues(
    utility: Utility,
    n: int,
    *,
    alpha: float = 1.0,
    beta: float = 1.0,
    truncation: float = 0.0,
    tolerance: float = 0.05,
    min_permutations: int = 10,
    max_permutations: int = 500,
    seed: int = 0,
    on_permutation: Callable[[int], None] | None = None,
) -> SemivalueResult:
    """Monte-Carlo semivalues from random permutations (TMC-Shapley with `truncation` > 0).

    Args:
        utility: sorted indices -> utility; wrapped in a `CachedUtility`.
        n: number of training samples.
        alpha: Beta-Shapley weight of small sets; (alpha, beta) = (1, 1) is Shapley.
        beta: Beta-Shapley weight of large sets.
        truncation: stop a permutation once |U(all) - U(prefix)| <= truncation * |U(all)|; the
            rest of it then contributes 0 (their marginals are below the utility's own noise).
            0 walks every permutation to the end (unbiased; values sum to U(all) - U(empty)).
        tolerance: stop once every value's standard error is at most `tolerance` times the
            average absolute value |U(all) - U(empty)| / n (checked from `min_permutations` on).
        max_permutations: stop here even if not converged (`converged` says which).
        on_permutation: called with the permutation count after each one (a progress bar).
    """
    if n < 1:
        raise LeantrainError("permutation_semivalues needs at least one sample")
    if not 1 <= min_permutations <= max_permutations:
        raise LeantrainError("need 1 <= min_permutations <= max_permutations")
    cached = utility if isinstance(utility, CachedUtility) else CachedUtility(utility)
    rng = np.random.default_rng(seed)
    position_weight = n * coalition_size_probs(n, alpha, beta)  # (n,) weight of position k
    empty, full = cached([]), cached(range(n))
    threshold = tolerance * abs(full - empty) / n
    sums, squares = np.zeros(n), np.zeros(n)
    done, converged = 0, False
    while done < max_permutations and not converged:
        order = rng.permutation(n)
        previous = empty
        for k, i in enumerate(order):
            if truncation > 0 and abs(full - previous) <= truncation * abs(full):
                break  # the rest of this permutation gets 0
            current = cached(order[: k + 1])
            contribution = position_weight[k] * (current - previous)
            sums[i] += contribution
            squares[i] += contribution * contribution
            previous = current
        done += 1
        if on_permutation is not None:
            on_permutation(done)
        if done >= max(min_permutations, 2):
            mean = sums / done
            std_error = np.sqrt(np.maximum(squares / done - mean**2, 0.0) / (done - 1))
            converged = bool(np.max(std_error) <= threshold)
    mean = sums / done
    variance = np.maximum(squares / done - mean**2, 0.0) / max(done - 1, 1)
    return SemivalueResult(mean, np.sqrt(variance), done, cached.evaluations, converged)


def leave_one_out(utility: Utility, n: int) -> np.ndarray:
    """U(all) - U(all without i) for every i: cheap, but blind to redundant samples."""
    everyone = np.arange(n)
    full = utility(everyone)
    return np.array([full - utility(np.delete(everyone, i)) for i in range(n)])


def knn_shapley(
    train_x: np.ndarray,
    train_y: np.ndarray,
    test_x: np.ndarray,
    test_y: np.ndarray,
    k: int,
    chunk: int = 256,
) -> np.ndarray:
    """Exact Shapley values of the training samples for the K-nearest-neighbour utility
    U(S) = mean over test points of (1/K) * (labels matching among the min(K, |S|) nearest in S).

    For one test point with training samples sorted by distance, a_1 nearest (1-based):
    s(a_N) = match(a_N) / N, and s(a_j) = s(a_{j+1}) + (match(a_j) - match(a_{j+1})) / K *
    min(K, j) / j. O(N log N) per test point instead of 2^N utilities. Ties in distance are
    broken by training index (a stable sort), as `knn_utility` does.
    """
    train_x, test_x = _as_matrix(train_x, "train_x"), _as_matrix(test_x, "test_x")
    n = len(train_x)
    if len(train_y) != n or len(test_y) != len(test_x) or n == 0 or k < 1:
        raise LeantrainError("knn_shapley: need matching x/y lengths, n >= 1 and k >= 1")
    train_t, labels = torch.from_numpy(train_x), torch.as_tensor(np.asarray(train_y))
    test_labels = torch.as_tensor(np.asarray(test_y))
    rank = torch.arange(1, n, dtype=torch.float64)  # j = 1..n-1 (1-based position)
    step = torch.clamp(rank, max=k) / (k * rank)  # min(K, j) / (K j)
    values = torch.zeros(n, dtype=torch.float64)
    for start in range(0, len(test_x), chunk):
        dist = torch.cdist(torch.from_numpy(test_x[start : start + chunk]), train_t)  # (b, n)
        order = torch.sort(dist, dim=1, stable=True).indices
        match = (labels[order] == test_labels[start : start + chunk, None]).double()  # (b, n)
        # s_j - s_{j+1} for j = 1..n-1, then summed from the far end back to each position.
        deltas = (match[:, :-1] - match[:, 1:]) * step
        tail = torch.flip(torch.cumsum(torch.flip(deltas, [1]), 1), [1])
        s = match[:, -1:] / n + torch.cat([tail, torch.zeros_like(tail[:, :1])], 1)
        values.scatter_add_(0, order.reshape(-1), s.reshape(-1))
    return (values / len(test_x)).numpy()


def knn_utility(
    train_x: np.ndarray, train_y: np.ndarray, test_x: np.ndarray, test_y: np.ndarray, k: int
) -> Utility:
    """The utility `knn_shapley` values, as a function of a training subset (for checking it by
    enumeration, or for other estimators)."""
    train_x, test_x = _as_matrix(train_x, "train_x"), _as_matrix(test_x, "test_x")
    dist = torch.cdist(torch.from_numpy(test_x), torch.from_numpy(train_x)).numpy()
    train_y, test_y = np.asarray(train_y), np.asarray(test_y)

    def utility(indices: np.ndarray) -> float:
        if len(indices) == 0:
            return 0.0
        order = indices[np.argsort(dist[:, indices], axis=1, kind="stable")][:, :k]
        return float(np.mean(np.sum(train_y[order] == test_y[:, None], axis=1) / k))

    return utility


def _as_matrix(x: np.ndarray, name: str) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 2:
        raise LeantrainError(f"{name} must be a 2-D array (samples, features), got {x.shape}")
    return x
