"""The bandit learns the best speculative configuration per batch-size bucket."""

from __future__ import annotations

from leantrain.speculation.bandit import Arm, BucketedEpsilonGreedy


def test_bandit_learns_the_best_arm_per_bucket():
    arms = [Arm("suffix", 2), Arm("suffix", 6)]
    bandit = BucketedEpsilonGreedy(arms, epsilon=0.0)
    assert bandit.choose(1) == arms[0] and bandit.best(1) is None  # untried arms go first
    bandit.update(1, arms[0], 10.0)
    assert bandit.choose(1) == arms[1]
    bandit.update(1, arms[1], 30.0)
    bandit.update(8, arms[0], 50.0)
    bandit.update(8, arms[1], 20.0)
    assert bandit.choose(1) == arms[1]  # batch 1: long drafts pay
    assert bandit.choose(8) == arms[0]  # batch 8 (another bucket): short ones do
    explorer = BucketedEpsilonGreedy(arms, epsilon=1.0, seed=0)
    for arm in arms:
        explorer.update(1, arm, 1.0 if arm.k == 2 else 0.0)
    assert {explorer.choose(1) for _ in range(50)} == set(arms)
