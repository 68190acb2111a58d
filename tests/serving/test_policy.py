"""Hit policies: the threshold rule, and the verified policy's exploration probability (vCache's
rule on a Beta-binomial bound) derived by hand and checked against its error guarantee."""

from __future__ import annotations

import random

import numpy as np
import pytest

from leantrain.errors import LeantrainError
from leantrain.serving.policy import (
    Evidence,
    ExplorePolicy,
    ThresholdPolicy,
    Verdicts,
    VerifiedPolicy,
    explore_probability,
    make_policy,
)


def test_threshold_hits_at_and_above_the_threshold_and_never_explores() -> None:
    policy = ThresholdPolicy(0.9)
    rng = random.Random(0)
    assert policy.decide(0.9, Evidence(), rng).hit
    assert not policy.decide(0.8999, Evidence(), rng).hit
    assert policy.decide(0.95, Evidence(), rng).explore_probability == 0.0


def test_no_evidence_always_explores() -> None:
    decision = VerifiedPolicy(0.02).decide(0.99, Evidence(), random.Random(0))
    assert not decision.hit and decision.explore_probability == 1.0


def test_explore_probability_matches_the_closed_form_for_all_right_evidence() -> None:
    """With n verdicts all right the posterior is Beta(n + 1, 1), whose eps-quantile is
    eps ** (1 / (n + 1)); so tau = min_eps 1 - delta / (1 - (1 - eps) * eps ** (1 / (n + 1)))."""
    eps = np.linspace(0.001, 0.5, 200)
    for n, delta in ((20, 0.02), (200, 0.02), (100, 0.05)):
        alpha = (1 - eps) * eps ** (1 / (n + 1))
        expected = np.clip(1 - delta / (1 - alpha), 0, 1).min()
        assert explore_probability(n, n, delta) == pytest.approx(expected, abs=1e-9)
    assert explore_probability(20, 20, 0.02) > 0.8  # 20 verdicts prove little at delta 0.02
    assert explore_probability(2000, 2000, 0.02) == 0.0  # 2000 right ones: always serve


def test_wrong_verdicts_and_smaller_delta_mean_more_exploration() -> None:
    base = explore_probability(300, 300, 0.02)
    assert explore_probability(290, 300, 0.02) > base
    assert explore_probability(300, 300, 0.01) > base
    # 10% wrong: served only so rarely that (1 - tau) * P(wrong) stays under delta.
    assert (1 - explore_probability(270, 300, 0.02)) * 0.1 <= 0.02


def test_shared_evidence_counts_with_its_weight() -> None:
    evidence = Evidence(own_right=10, own_seen=10, shared_right=500, shared_seen=500)
    rng = random.Random(0)
    alone = VerifiedPolicy(0.02, share_weight=0.0).decide(0.99, evidence, rng)
    pooled = VerifiedPolicy(0.02, share_weight=1.0).decide(0.99, evidence, rng)
    assert alone.explore_probability > 0.8 and pooled.explore_probability == 0.0
    assert pooled.predicted_correct == pytest.approx(511 / 512)


@pytest.mark.parametrize("p_correct", [0.9, 0.97, 1.0])
def test_realised_error_rate_stays_under_delta(p_correct: float) -> None:
    """One entry whose cached answer is right with probability p_correct: explore, learn from
    each exploration's verdict, and count wrong answers served."""
    rng = random.Random(1)
    policy, delta = VerifiedPolicy(0.02), 0.02
    right = seen = wrong_served = 0
    requests = 2000
    for _ in range(requests):
        decision = policy.decide(0.95, Evidence(right, seen), rng)
        correct = rng.random() < p_correct
        if decision.hit:
            wrong_served += not correct
        else:
            right, seen = right + correct, seen + 1
    assert wrong_served / requests <= delta
    if p_correct == 1.0:
        assert seen < requests / 2  # a reliable entry ends up served most of the time


def test_verdicts_count_right_and_seen_in_a_similarity_window() -> None:
    verdicts = Verdicts(np.array([0.99, 0.9, 1.0, 0.95, 0.99]), np.array([0, 0, 1, 1, 1]))
    assert len(verdicts) == 5 and verdicts.right == 3
    assert verdicts.count(0.95, 0.99) == (2, 3)  # both ends included
    assert verdicts.count(0.991, 1.0) == (1, 1)
    assert verdicts.count(0.5, 0.8) == (0, 0)
    with pytest.raises(LeantrainError, match="one similarity per verdict"):
        Verdicts(np.array([0.9, 0.95]), np.array([True]))


def test_a_prior_counts_like_shared_evidence_inside_the_window_only() -> None:
    """500 right calibration verdicts at 0.999: at 1.0 (window 0.003 reaches down to 0.997) the
    policy decides as if they were shared evidence; at 0.99 they are out of the window."""
    prior = Verdicts(np.full(500, 0.999), np.ones(500, dtype=bool))
    rng = random.Random(0)
    warm = VerifiedPolicy(0.02, window=0.003, prior=prior)
    pooled = VerifiedPolicy(0.02, window=0.003).decide(1.0, Evidence(0, 0, 500, 500), rng)
    at_one = warm.decide(1.0, Evidence(), rng)
    assert at_one.explore_probability == pooled.explore_probability == 0.0 and at_one.hit
    assert at_one.predicted_correct == pytest.approx(501 / 502)
    assert warm.decide(0.99, Evidence(), rng).explore_probability == 1.0  # no evidence there
    # Half weight: 250 right verdicts' worth is not enough to stop exploring at delta 0.02.
    half = VerifiedPolicy(0.02, window=0.003, prior=prior, prior_weight=0.5)
    assert half.decide(1.0, Evidence(), rng).explore_probability == pytest.approx(
        explore_probability(250, 250, 0.02)
    )
    assert ExplorePolicy().decide(1.0, Evidence(10, 10), rng).hit is False


def test_bad_settings_are_refused() -> None:
    with pytest.raises(LeantrainError, match="delta"):
        VerifiedPolicy(0.0)
    with pytest.raises(LeantrainError, match="prior_weight"):
        VerifiedPolicy(0.02, prior_weight=2.0)
    with pytest.raises(LeantrainError, match="threshold"):
        ThresholdPolicy(1.5)
    with pytest.raises(LeantrainError, match="policy must be one of"):
        make_policy("always")
