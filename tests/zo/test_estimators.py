"""Estimators on a small quadratic, where the true gradient is known in closed form.

f(theta) = 1/2 theta^T A theta + b^T theta, grad f = A theta + b. Central differences are exact
on a quadratic, so each SPSA estimate g = (f(theta + eps z) - f(theta - eps z)) / (2 eps) is the
directional derivative z . grad f, and E[g z] = E[z z^T] grad f = grad f for z ~ N(0, I).
"""

from __future__ import annotations

import pytest
import torch

from leantrain.errors import LeantrainError
from leantrain.zo.directions import Directions, SeedStream
from leantrain.zo.estimators import SPSA, OneSided, make_estimator

DIM = 6


def quadratic() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    m = torch.randn(DIM, DIM, generator=gen, dtype=torch.float64)
    return (
        m @ m.T / DIM + torch.eye(DIM, dtype=torch.float64),
        torch.randn(DIM, generator=gen, dtype=torch.float64),
        torch.randn(DIM, generator=gen, dtype=torch.float64),
    )


def run_plan(estimator, theta: torch.Tensor, seeds: list[int], f) -> list[float]:
    """Score the plan's states of `f` at `theta` (moved in place and back); return the losses."""
    directions = Directions([theta])
    plan = estimator.plan(seeds)
    losses = []
    for moves in plan.moves:
        for seed, scale in moves:
            directions.move_(seed, scale, estimator.eps)
        losses.append(float(f(theta)))
    for seed, scale in plan.back:
        directions.move_(seed, scale, estimator.eps)
    return losses


def z_of(seed: int) -> torch.Tensor:
    return torch.empty(DIM, dtype=torch.float64).normal_(
        generator=torch.Generator().manual_seed(seed)
    )


def test_spsa_is_the_directional_derivative_and_unbiased() -> None:
    a, b, theta = quadratic()
    f = lambda t: 0.5 * t @ a @ t + b @ t  # noqa: E731
    grad = a @ theta + b
    start = theta.clone()
    spsa = SPSA(eps=1e-3)
    seeds = SeedStream(0).next(4000)
    mean = torch.zeros(DIM, dtype=torch.float64)
    for seed in seeds:
        [g] = spsa.coefficients(run_plan(spsa, theta, [seed], f))
        z = z_of(seed)
        assert g == pytest.approx(float(z @ grad), rel=1e-6, abs=1e-8)
        mean += g * z / len(seeds)
    torch.testing.assert_close(theta, start, rtol=0, atol=1e-12)  # every plan came back
    # Monte Carlo error of a mean of 4000 draws of g z: about |grad| * sqrt(DIM / 4000).
    assert float((mean - grad).norm()) < 4 * float(grad.norm()) * (DIM / len(seeds)) ** 0.5
    cosine = float(mean @ grad / (mean.norm() * grad.norm()))
    assert cosine > 0.95


def test_n_spsa_averages_its_directions() -> None:
    a, b, theta = quadratic()
    f = lambda t: 0.5 * t @ a @ t + b @ t  # noqa: E731
    grad = a @ theta + b
    spsa = SPSA(eps=1e-3, directions=3)
    seeds = [5, 6, 7]
    grads = spsa.coefficients(run_plan(spsa, theta, seeds, f))
    expected = [float(z_of(s) @ grad) / 3 for s in seeds]
    assert grads == pytest.approx(expected, rel=1e-6)


def test_one_sided_scores_the_base_then_each_direction() -> None:
    a, b, theta = quadratic()
    f = lambda t: 0.5 * t @ a @ t + b @ t  # noqa: E731
    est = OneSided(eps=1e-4, directions=4)
    seeds = [1, 2, 3, 4]
    losses = run_plan(est, theta, seeds, f)
    assert losses[0] == pytest.approx(float(f(theta)), rel=1e-12)
    assert len(losses) == 5
    grads = est.coefficients(losses)
    # (L_j - L0) is about eps z_j . grad; dividing by the spread of the L_j (eps times the spread
    # of z_j . grad) leaves the directional derivatives in units of their own spread.
    derivs = torch.tensor([float(z_of(s) @ (a @ theta + b)) for s in seeds])
    expected = derivs / (4 * derivs.std(unbiased=False))
    assert grads == pytest.approx(expected.tolist(), rel=1e-3)


def test_estimator_settings_are_checked() -> None:
    with pytest.raises(LeantrainError, match="directions must be >= 2"):
        OneSided(eps=1e-3, directions=1)
    with pytest.raises(LeantrainError, match="unknown ZO estimator"):
        make_estimator("adam", 1e-3, 1)
