"""Shared task helpers: checking reward parts, solution-length statistics."""

from __future__ import annotations

import math
import random

import pytest

from leantrain.errors import LeantrainError
from leantrain.tasks.base import Example, Task, check_parts, length_stats


class _Fixed(Task):
    """Solutions of lengths 1..100, each once per 100 draws."""

    name = "fixed"

    def sample(self, rng: random.Random) -> Example:
        return Example(prompt="", answer="", solution="x" * rng.randint(1, 100))

    def score(self, example: Example, response: str) -> dict[str, float]:
        return {}


def test_check_parts_accepts_numbers_of_known_parts() -> None:
    assert check_parts({"format": 1, "answer": True, "tool": 0.5}, "f") == {
        "format": 1.0,
        "answer": 1.0,
        "tool": 0.5,
    }


@pytest.mark.parametrize(
    ("parts", "error"),
    [
        (0.5, TypeError),
        ({"answr": 1.0}, ValueError),
        ({"answer": "1"}, ValueError),
        ({"answer": None}, ValueError),
        ({"answer": math.nan}, ValueError),
        ({"answer": math.inf}, ValueError),
    ],
)
def test_check_parts_names_the_source(parts: object, error: type[Exception]) -> None:
    with pytest.raises(error, match="my_reward"):
        check_parts(parts, "my_reward")


def test_length_stats_are_nearest_rank_percentiles() -> None:
    stats = length_stats(_Fixed(), n=20_000, seed=0)
    assert set(stats) == {"p50", "p90", "p99", "max"}
    assert abs(stats["p50"] - 50) <= 3
    assert abs(stats["p90"] - 90) <= 3
    assert abs(stats["p99"] - 99) <= 1
    assert stats["max"] == 100


def test_length_stats_needs_solutions() -> None:
    class NoSolutions(_Fixed):
        def sample(self, rng: random.Random) -> Example:
            return Example(prompt="", answer="")

    with pytest.raises(LeantrainError, match="solutions"):
        length_stats(NoSolutions(), n=10)
    with pytest.raises(LeantrainError):
        length_stats(_Fixed(), n=0)
