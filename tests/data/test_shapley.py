"""Shapley estimators against games with known values: a weighted voting game (closed form), a
symmetric majority game, small games enumerated exactly, and KNN-Shapley's closed form."""

from __future__ import annotations

import math
from itertools import permutations

import numpy as np
import pytest

from leantrain.data.shapley import (
    CachedUtility,
    coalition_size_probs,
    exact_semivalues,
    knn_shapley,
    knn_utility,
    leave_one_out,
    permutation_semivalues,
)
from leantrain.errors import LeantrainError


def voting_game(weights: list[float], quota: float):
    """Weighted voting: a coalition wins (utility 1) when its weights reach the quota."""
    w = np.asarray(weights)
    return lambda s: float(w[s].sum() >= quota)


def random_game(n: int, seed: int):
    """A game with an arbitrary value for every coalition (no structure to exploit)."""
    table = np.random.default_rng(seed).normal(size=1 << n)
    return lambda s: float(table[int(np.sum(1 << np.asarray(s, dtype=np.int64)))])


def shapley_by_orders(game, n: int) -> np.ndarray:
    """Textbook definition: average marginal contribution over all n! orders."""
    values = np.zeros(n)
    orders = list(permutations(range(n)))
    for order in orders:
        for k, i in enumerate(order):
            values[i] += game(np.array(sorted(order[: k + 1]))) - game(np.array(sorted(order[:k])))
    return values / len(orders)


def test_exact_enumeration_gives_the_voting_game_closed_form() -> None:
    """[51; 50, 49, 1]: the 50-vote player is pivotal in 4 of the 6 orders, the others in 1."""
    values = exact_semivalues(voting_game([50, 49, 1], 51), 3)
    np.testing.assert_allclose(values, [4 / 6, 1 / 6, 1 / 6], atol=1e-12)


def test_exact_enumeration_matches_all_orders_on_an_arbitrary_game() -> None:
    game = random_game(5, seed=1)
    np.testing.assert_allclose(exact_semivalues(game, 5), shapley_by_orders(game, 5), atol=1e-12)


def test_beta_weights_are_a_distribution_and_reduce_to_shapley() -> None:
    np.testing.assert_allclose(coalition_size_probs(6, 1.0, 1.0), np.full(6, 1 / 6))
    np.testing.assert_allclose(coalition_size_probs(6, 1.0 + 1e-12, 1.0), np.full(6, 1 / 6))
    p = coalition_size_probs(6, 16.0, 1.0)
    assert p.sum() == pytest.approx(1.0) and np.all(np.diff(p) < 0)  # small coalitions first
    # Beta(alpha, beta) weight by hand: C(n-1, k) B(k + beta, n-1-k + alpha) / B(alpha, beta).
    beta_fn = lambda a, b: math.gamma(a) * math.gamma(b) / math.gamma(a + b)  # noqa: E731
    assert p[2] == pytest.approx(math.comb(5, 2) * beta_fn(2 + 1, 3 + 16) / beta_fn(16, 1))
    with pytest.raises(LeantrainError, match="alpha"):
        coalition_size_probs(6, 0.0, 1.0)


def test_exact_beta_shapley_weights_coalitions_by_size() -> None:
    """An additive game gives every semivalue the player's own weight; a pure size game
    U(S) = f(|S|) gives each of n players sum_k p(k) (f(k+1) - f(k))."""
    w = np.array([0.5, -1.0, 2.0, 0.25])
    np.testing.assert_allclose(exact_semivalues(lambda s: w[s].sum(), 4, 4.0, 1.0), w, atol=1e-12)
    f = np.array([0.0, 1.0, 1.5, 1.75, 1.8])
    p = coalition_size_probs(4, 4.0, 2.0)
    expected = np.sum(p * np.diff(f))
    got = exact_semivalues(lambda s: f[len(s)], 4, 4.0, 2.0)
    np.testing.assert_allclose(got, np.full(4, expected), atol=1e-12)


@pytest.mark.parametrize("alpha,beta", [(1.0, 1.0), (4.0, 1.0), (16.0, 1.0)])
def test_permutation_estimates_match_exact_enumeration(alpha: float, beta: float) -> None:
    game = random_game(6, seed=2)
    exact = exact_semivalues(game, 6, alpha, beta)
    result = permutation_semivalues(
        game, 6, alpha=alpha, beta=beta, tolerance=0.0, max_permutations=6000, seed=0
    )
    assert np.max(np.abs(result.values - exact)) < 4 * np.max(result.std_errors) + 1e-9
    assert np.max(result.std_errors) < 0.1
    assert result.permutations == 6000 and not result.converged


def test_tmc_on_a_symmetric_majority_game_is_efficient_and_fair() -> None:
    """20 equal voters, quota 11: every voter's Shapley value is 1/20 by symmetry."""
    n = 20
    game = voting_game([1.0] * n, 11)
    result = permutation_semivalues(game, n, truncation=0.01, tolerance=0.2, max_permutations=4000)
    assert result.converged and result.permutations < 4000
    np.testing.assert_allclose(result.values, 1 / n, atol=4 * np.max(result.std_errors))
    # Efficiency: every permutation's marginals telescope to U(prefix at truncation) - U(empty),
    # and truncation only stops at a prefix within 1% of U(all) = 1.
    assert result.values.sum() == pytest.approx(
        game(np.arange(n)) - game(np.array([], dtype=np.int64)), abs=0.01
    )
    # Truncation saves work: past the 11th voter the rest of a permutation costs nothing.
    assert result.utility_evaluations < result.permutations * 12


def test_untruncated_permutation_values_sum_exactly_to_the_total_utility() -> None:
    game = random_game(8, seed=3)
    result = permutation_semivalues(game, 8, tolerance=0.0, max_permutations=37, seed=5)
    total = game(np.arange(8)) - game(np.array([], dtype=np.int64))
    assert result.values.sum() == pytest.approx(total, abs=1e-10)


def test_cached_utility_counts_distinct_coalitions() -> None:
    calls = []
    cached = CachedUtility(lambda s: calls.append(tuple(s)) or float(len(s)))
    assert cached([2, 0]) == 2.0 and cached([0, 2]) == 2.0 and cached(np.array([1])) == 1.0
    assert calls == [(0, 2), (1,)] and cached.evaluations == 2


def test_leave_one_out_on_the_voting_game() -> None:
    """Only the 50-vote player's departure breaks the 100-vote coalition: 50 + 49 + 1 - 50 < 51,
    while 50 + 1 >= 51 (without the 49) and 50 + 49 >= 51 (without the 1)."""
    np.testing.assert_array_equal(leave_one_out(voting_game([50, 49, 1], 51), 3), [1, 0, 0])


@pytest.mark.parametrize("k", [1, 3, 5])
def test_knn_shapley_equals_exact_enumeration(k: int) -> None:
    rng = np.random.default_rng(k)
    train_x, test_x = rng.normal(size=(10, 3)), rng.normal(size=(7, 3))
    train_y, test_y = rng.integers(0, 2, 10), rng.integers(0, 2, 7)
    closed_form = knn_shapley(train_x, train_y, test_x, test_y, k, chunk=3)
    exact = exact_semivalues(knn_utility(train_x, train_y, test_x, test_y, k), 10)
    np.testing.assert_allclose(closed_form, exact, atol=1e-8, rtol=0)
    # Efficiency of the closed form: values sum to the utility of the whole training set.
    full = knn_utility(train_x, train_y, test_x, test_y, k)(np.arange(10))
    assert closed_form.sum() == pytest.approx(full, abs=1e-12)


def test_knn_shapley_ranks_a_flipped_label_last() -> None:
    rng = np.random.default_rng(0)
    centers = np.array([[-3.0, 0.0], [3.0, 0.0]])
    y = rng.integers(0, 2, 60)
    x = centers[y] + rng.normal(size=(60, 2))
    noisy = y.copy()
    noisy[:5] = 1 - noisy[:5]
    values = knn_shapley(x[:40], noisy[:40], x[40:], y[40:], k=5)
    assert set(np.argsort(values)[:5]) == set(range(5))


def test_bad_inputs_raise_user_errors() -> None:
    with pytest.raises(LeantrainError, match="2-D"):
        knn_shapley(np.zeros(3), np.zeros(3), np.zeros((1, 1)), np.zeros(1), 1)
    with pytest.raises(LeantrainError, match="n <= 20"):
        exact_semivalues(lambda s: 0.0, 21)
    with pytest.raises(LeantrainError, match="min_permutations"):
        permutation_semivalues(lambda s: 0.0, 3, min_permutations=5, max_permutations=2)
