"""What a verifiable task is: a prompt generator with ground truth, and a scorer that turns a
decoded response into named reward parts. Knows nothing about models or tokens."""

from __future__ import annotations

import math
import random
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from numbers import Real
from typing import Any

from leantrain.errors import LeantrainError

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
    define is simply absent. `parts` lists the parts a task scores, so that a failed scoring can
    report zero for each of them.
    """

    name: str = "task"
    parts: tuple[str, ...] = REWARD_PARTS
    # Whether `examples` with another seed draws problems training has not seen: a generator
    # does; a task over a fixed list of rows (jsonl) draws from the same rows.
    unseen_per_seed: bool = True

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


def check_parts(parts: object, source: str) -> dict[str, float]:
    """`parts` as a plain {part: float} dict, or a ValueError/TypeError naming `source` (a task or
    reward function) if it is not a mapping of known part names to finite numbers."""
    if not isinstance(parts, Mapping):
        raise TypeError(f"{source} returned {type(parts).__name__}, expected a dict of parts")
    checked = {}
    for key, value in parts.items():
        if key not in REWARD_PARTS:
            raise ValueError(f"{source} returned part {key!r}, expected one of {REWARD_PARTS}")
        if not isinstance(value, Real) or not math.isfinite(value):
            raise ValueError(f"{source} returned {key}={value!r}, expected a finite number")
        checked[key] = float(value)
    return checked


def length_stats(task: Task, n: int = 5000, seed: int = 0) -> dict[str, int]:
    """Length in characters of `n` worked solutions: p50, p90, p99 (nearest rank) and max.

    A quick look at how long-tailed a task's responses will be before any model writes one.
    """
    lengths = sorted(len(ex.solution) for ex in task.examples(n, seed) if ex.solution is not None)
    if n < 1 or len(lengths) < n:
        raise LeantrainError(f"length_stats needs n >= 1 examples with solutions from {task.name}")
    stats = {f"p{q}": lengths[math.ceil(q / 100 * n) - 1] for q in (50, 90, 99)}
    return {**stats, "max": lengths[-1]}
