"""Turn a task's reward parts into the one number GRPO uses, and score without ever crashing a run.

`total` is the weighted sum of the parts a task returned (a part it does not define adds nothing).
`score_safely` wraps `Task.score`: if the scorer raises or returns something malformed, the error
("Type: message") is recorded, every part the task defines scores 0, and the run goes on.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from leantrain.tasks.base import Example, Task, check_parts
from leantrain.tasks.config import RewardWeights


@dataclass(frozen=True)
class ScoreResult:
    """One scored response.

    Attributes:
        parts: reward parts, e.g. {"format": 1.0, "answer": 0.0}.
        total: their weighted sum.
        error: "ExceptionType: message" if scoring failed (then every part is 0), else None.
    """

    parts: dict[str, float]
    total: float
    error: str | None = None


def total(parts: Mapping[str, float], weights: RewardWeights | None = None) -> float:
    """Weighted sum of reward parts; the weights default to `RewardWeights()`."""
    weights = weights or RewardWeights()
    unknown = sorted(set(parts) - set(RewardWeights.model_fields))
    if unknown:
        raise ValueError(f"no weight for reward part(s) {unknown}")
    return sum((getattr(weights, name) * value for name, value in parts.items()), 0.0)


def score_safely(
    task: Task, example: Example, response: str, weights: RewardWeights | None = None
) -> ScoreResult:
    """Score `response` with `task`; never raises for an error in the scorer.

    KeyboardInterrupt and other BaseExceptions still propagate: they are the user stopping the
    run, not a broken reward.
    """
    try:
        parts = check_parts(task.score(example, response), f"task {task.name!r}")
    except Exception as exc:
        zeros = dict.fromkeys(task.parts, 0.0)
        return ScoreResult(parts=zeros, total=0.0, error=f"{type(exc).__name__}: {exc}")
    return ScoreResult(parts=parts, total=total(parts, weights))
