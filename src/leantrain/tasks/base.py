"""What a verifiable task is: a prompt generator with ground truth, and a scorer that turns a
decoded response into named reward parts. Knows nothing about models or tokens."""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

REWARD_PARTS = ("format", "answer", "tool")


@dataclass(frozen=True)
class Example:
    """One problem. `solution` is a worked solution (built-in tasks only), used to warm-start."""

    prompt: str
    answer: str
    solution: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)


class Task(ABC):
    """A source of problems and their verifier.

    Subclasses implement `sample` (one problem from a seeded RNG) and `score` (reward parts in
    [0, 1] for a decoded response). Scores name parts from `REWARD_PARTS`; a part a task does not
    define is simply absent.
    """

    name: str = "task"

    @abstractmethod
    def sample(self, rng: random.Random) -> Example:
        """Draw one problem."""

    @abstractmethod
    def score(self, example: Example, response: str) -> dict[str, float]:
        """Score a decoded response into reward parts, e.g. {"format": 1.0, "answer": 0.0}."""

    def examples(self, n: int, seed: int) -> list[Example]:
        """`n` problems, the same for the same seed."""
        rng = random.Random(seed)
        return [self.sample(rng) for _ in range(n)]
