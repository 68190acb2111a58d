"""Combining reward parts, and scoring that records a broken reward instead of crashing."""

from __future__ import annotations

import random

import pytest
from pydantic import ValidationError

from leantrain.tasks.arith import ArithTask
from leantrain.tasks.base import REWARD_PARTS, Example, Task
from leantrain.tasks.config import RewardWeights
from leantrain.tasks.rewards import ScoreResult, score_safely, total


class _Broken(Task):
    """A task whose scorer fails, or returns what `returns` says."""

    name = "broken"
    parts = ("format", "answer")

    def __init__(self, returns: object = None) -> None:
        self.returns = returns

    def sample(self, rng: random.Random) -> Example:
        return Example(prompt="p", answer="a")

    def score(self, example: Example, response: str) -> dict[str, float]:
        if self.returns is None:
            raise KeyError("no such column")
        return self.returns  # type: ignore[return-value]


def test_weights_cover_every_part() -> None:
    assert tuple(RewardWeights.model_fields) == REWARD_PARTS


def test_total_is_the_weighted_sum_of_present_parts() -> None:
    assert total({"format": 1.0, "answer": 1.0}) == pytest.approx(1.1)
    assert total({"format": 1.0, "answer": 0.0}) == pytest.approx(0.1)
    assert total({"format": 1.0, "tool": 1.0}) == pytest.approx(1.1)
    assert total({}) == 0.0
    weights = RewardWeights(format=0.5, answer=2.0, tool=0.0)
    assert total({"format": 1.0, "answer": 0.5, "tool": 1.0}, weights) == pytest.approx(1.5)


def test_total_refuses_unknown_parts() -> None:
    with pytest.raises(ValueError, match="speed"):
        total({"speed": 1.0})


def test_weights_refuse_unknown_names_and_non_finite_values() -> None:
    with pytest.raises(ValidationError, match="answr"):
        RewardWeights(answr=1.0)  # type: ignore[call-arg]
    with pytest.raises(ValidationError):
        RewardWeights(answer=float("nan"))


def test_score_safely_scores_a_working_task() -> None:
    task = ArithTask()
    example = task.examples(1, seed=0)[0]
    result = score_safely(task, example, example.solution or "")
    assert result == ScoreResult(parts={"format": 1.0, "answer": 1.0}, total=pytest.approx(1.1))


def test_score_safely_records_a_raising_reward_and_zeroes_every_part() -> None:
    result = score_safely(_Broken(), Example(prompt="p", answer="a"), "r")
    assert result.parts == {"format": 0.0, "answer": 0.0}
    assert result.total == 0.0
    assert result.error == "KeyError: 'no such column'"


@pytest.mark.parametrize(
    ("returns", "message"),
    [
        (1.0, "returned float, expected a dict"),
        ({"answer": float("nan")}, "expected a finite number"),
        ({"reward": 1.0}, "part 'reward'"),
    ],
)
def test_score_safely_records_a_malformed_score(returns: object, message: str) -> None:
    result = score_safely(_Broken(returns), Example(prompt="p", answer="a"), "r")
    assert result.parts == {"format": 0.0, "answer": 0.0}
    assert result.error is not None and message in result.error
    assert "broken" in result.error


def test_score_safely_lets_keyboard_interrupt_through() -> None:
    class Interrupted(_Broken):
        def score(self, example: Example, response: str) -> dict[str, float]:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        score_safely(Interrupted(), Example(prompt="p", answer="a"), "r")
