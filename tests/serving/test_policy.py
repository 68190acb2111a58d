"""Hit policies: the threshold rule, the verified policy's exploration probability (vCache's
rule on a Beta-binomial bound) and the budgeted policy's water-filling and slack, derived by hand
and checked against their error guarantees."""

from __future__ import annotations

import random

import numpy as np
import pytest

from leantrain.errors import LeantrainError
from leantrain.serving.policy import (
    BudgetedPolicy,
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


def _evidence(right: int, seen: int) -> Evidence:
    """Evidence whose posterior mean of P(wrong) is (1 + seen - right) / (2 + seen)."""
    return Evidence(shared_right=right, shared_seen=seen)


def test_budgeted_serves_nothing_until_the_slack_is_covered() -> None:
    """Risk ~1e-6: the first hit is the first k with delta k - z sqrt(delta k) >= 0, i.e.
    k >= z**2 / delta = 135.3 at z = 1.645, delta = 0.02."""
    policy, rng = BudgetedPolicy(0.02), random.Random(0)
    hits = [policy.decide(1.0, _evidence(10**6, 10**6), rng).hit for _ in range(140)]
    assert hits.index(True) + 1 == 136 and all(hits[135:])
    assert policy.requests == 140 and policy.spent == pytest.approx(5 / (10**6 + 2))


def test_budgeted_water_filling_gives_the_marginal_bin_what_is_left() -> None:
    """z = 0, so the level is delta. Risks 5/2000 = 0.0025 and 101/2000 = 0.0505, per request
    so far (2): the low one costs 0.0025 / 2, the high one 0.0505 / 2, so the high one is served
    with probability (0.02 - 0.00125) / 0.02525; the low one, alone in the budget, always."""
    policy, rng = BudgetedPolicy(0.02, z=0.0), random.Random(0)
    low = policy.decide(0.99, _evidence(1994, 1998), rng)
    high = policy.decide(0.99, _evidence(1898, 1998), rng)
    assert low.hit and low.explore_probability == 0.0
    assert low.predicted_correct == pytest.approx(1 - 0.0025)
    assert high.explore_probability == pytest.approx(1 - 0.01875 / 0.02525)
    assert not high.hit  # 0.0025 + 0.0505 spent would exceed the budget of 2 x 0.02


def test_budgeted_spends_the_budget_on_the_safe_requests_first_and_stays_under_delta() -> None:
    """Half the requests are safe (wrong 0.5% of the time), half risky (10%), and the evidence
    says so. The budgeted policy serves every safe one (after the slack) and risky ones only with
    what is left; the realised error rate stays under delta, and it serves more than the
    verified policy, which must keep each request's own error probability under delta."""
    delta, requests = 0.02, 4000
    kinds = {"safe": (0.005, _evidence(1990, 2000)), "risky": (0.1, _evidence(900, 1000))}
    served = {}
    for policy in (BudgetedPolicy(delta), VerifiedPolicy(delta)):
        rng, draws = random.Random(0), random.Random(1)
        hits = {"safe": 0, "risky": 0}
        wrong = 0
        for i in range(requests):
            kind = "safe" if i % 2 else "risky"
            p_wrong, evidence = kinds[kind]
            if policy.decide(0.99, evidence, rng).hit:
                hits[kind] += 1
                wrong += draws.random() < p_wrong
        assert wrong / requests <= delta
        served[policy.name] = hits
    budgeted, verified = served["budgeted"], served["verified"]
    assert budgeted["safe"] >= requests / 2 - 136  # all but the slack's first requests
    assert 0 < budgeted["risky"] < requests / 4
    assert sum(budgeted.values()) > sum(verified.values())


def test_a_restored_budget_decides_as_the_one_it_was_saved_from() -> None:
    """`state()` then `restore()` carries the budget over exactly: given the same draws, the
    restored policy makes the running one's decisions; other settings keep a fresh budget."""
    evidences = [_evidence(1990, 2000), _evidence(900, 1000), _evidence(10**6, 10**6)]
    running, rng = BudgetedPolicy(0.02), random.Random(0)
    for i in range(500):
        running.decide(0.99, evidences[i % 3], rng)
    restored, rng_restored = BudgetedPolicy(0.02), random.Random()
    assert restored.restore(running.state())
    rng_restored.setstate(rng.getstate())
    decisions = [
        (
            running.decide(0.99, evidences[i % 3], rng),
            restored.decide(0.99, evidences[i % 3], rng_restored),
        )
        for i in range(500)
    ]
    assert all(a == b for a, b in decisions)
    assert sum(a.hit for a, _ in decisions) > 0  # the budget is in use, not trivially empty
    assert (restored.requests, restored.spent) == (running.requests, running.spent)
    fresh = BudgetedPolicy(0.05)
    assert not fresh.restore(running.state()) and (fresh.requests, fresh.spent) == (0, 0.0)


def test_bad_settings_are_refused() -> None:
    with pytest.raises(LeantrainError, match="delta"):
        VerifiedPolicy(0.0)
    with pytest.raises(LeantrainError, match="prior_weight"):
        VerifiedPolicy(0.02, prior_weight=2.0)
    with pytest.raises(LeantrainError, match="z must be"):
        BudgetedPolicy(0.02, z=-1.0)
    with pytest.raises(LeantrainError, match="threshold"):
        ThresholdPolicy(1.5)
    with pytest.raises(LeantrainError, match="policy must be one of"):
        make_policy("always")


def test_make_policy_builds_each_named_policy_with_its_delta():
    for name, cls in (("verified", VerifiedPolicy), ("budgeted", BudgetedPolicy)):
        policy = make_policy(name, delta=0.05)
        assert isinstance(policy, cls) and policy.delta == 0.05
    assert make_policy("threshold", threshold=0.97).threshold == 0.97
