"""TLT's BEG-MAB: a bucketed epsilon-greedy multi-armed bandit that picks the speculative
configuration (drafter type and draft length) for each decoding step.

The best draft length depends on how many sequences are live (a bigger batch leaves less idle
compute for verification), so each batch-size bucket learns its own choice. Within a bucket: with
probability epsilon a random arm, otherwise the arm with the highest median reward over a sliding
window (the median shrugs off the odd slow step on a shared machine). Untried arms go first.
Reward: tokens produced per second by the step.
"""

from __future__ import annotations

import bisect
import random
import statistics
from collections import deque
from dataclasses import dataclass

# Upper edges of the batch-size buckets (TLT's [1, 2, 5, 21]), then one open bucket.
BUCKET_EDGES = (1, 2, 5, 21)


@dataclass(frozen=True)
class Arm:
    """One speculative configuration: drafter type and draft length (k = 0: no speculation)."""

    drafter: str
    k: int

    @property
    def label(self) -> str:
        return f"{self.drafter}:{self.k}"


class BucketedEpsilonGreedy:
    """Epsilon-greedy over `arms`, one set of reward windows per batch-size bucket.

    Args:
        arms: the configurations to choose from.
        epsilon: exploration probability.
        window: rewards kept per (bucket, arm); the median over them ranks arms.
        seed: seeds exploration.
    """

    def __init__(
        self, arms: list[Arm], *, epsilon: float = 0.1, window: int = 1000, seed: int = 0
    ) -> None:
        if not arms:
            raise ValueError("the bandit needs at least one arm")
        self.arms = arms
        self.epsilon = epsilon
        self.window = window
        self.rng = random.Random(seed)
        self.rewards: dict[tuple[int, Arm], deque[float]] = {}

    @staticmethod
    def bucket(live: int) -> int:
        """Index of the bucket holding batch size `live`."""
        return bisect.bisect_left(BUCKET_EDGES, live)

    def choose(self, live: int) -> Arm:
        """The arm to play at batch size `live`."""
        b = self.bucket(live)
        untried = [a for a in self.arms if (b, a) not in self.rewards]
        if untried:
            return untried[0]
        if self.rng.random() < self.epsilon:
            return self.rng.choice(self.arms)
        return self.best(live)

    def update(self, live: int, arm: Arm, reward: float) -> None:
        """Record the reward (tokens per second) that `arm` earned at batch size `live`."""
        key = (self.bucket(live), arm)
        self.rewards.setdefault(key, deque(maxlen=self.window)).append(reward)

    def best(self, live: int) -> Arm | None:
        """The arm with the highest median reward at batch size `live` (None before any)."""
        b = self.bucket(live)
        tried = [a for a in self.arms if (b, a) in self.rewards]
        return max(tried, key=lambda a: statistics.median(self.rewards[b, a])) if tried else None
