"""Verifiable tasks (prompt generator + verifier) and reward functions.

`make_task("countdown", max_number=20)` builds a task by name; options are the task's dataclass
fields, checked and converted (so "20" from a command line becomes 20) before the task is built.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from pydantic import TypeAdapter, ValidationError

from leantrain.errors import LeantrainError
from leantrain.tasks.arith import ArithTask
from leantrain.tasks.base import REWARD_PARTS, Example, Task, check_parts, length_stats
from leantrain.tasks.code import CodeTask
from leantrain.tasks.config import RewardWeights
from leantrain.tasks.countdown import CountdownTask
from leantrain.tasks.jsonl import JsonlTask
from leantrain.tasks.rewards import ScoreResult, score_safely, total
from leantrain.tasks.sentiment import SentimentTask
from leantrain.tasks.tool_arith import ToolArithTask
from leantrain.tasks.visual import VisualTask

TASKS: dict[str, type[Task]] = {
    "arith": ArithTask,
    "countdown": CountdownTask,
    "code": CodeTask,
    "jsonl": JsonlTask,
    "sentiment": SentimentTask,
    "tool_arith": ToolArithTask,
    "visual": VisualTask,
}


def make_task(name: str, **options: Any) -> Task:
    """The task registered as `name`, built with `options`; a LeantrainError names what is wrong
    (an unknown task, an unknown or missing option, a value of the wrong type or out of range)."""
    if name not in TASKS:
        raise LeantrainError(f"unknown task {name!r}; known tasks: {', '.join(TASKS)}")
    cls = TASKS[name]
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = [key for key in options if key not in fields]
    if unknown:
        raise LeantrainError(
            f"task {name!r} has no option(s) {unknown}; options: {', '.join(fields)}"
        )
    missing = [
        key
        for key, f in fields.items()
        if key not in options
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise LeantrainError(f"task {name!r} needs option(s) {missing}")
    hints = typing.get_type_hints(cls)
    converted = {}
    for key, value in options.items():
        try:
            converted[key] = TypeAdapter(hints[key]).validate_python(value)
        except ValidationError as exc:
            expected = exc.errors()[0]["msg"]
            raise LeantrainError(f"task {name!r} option {key!r}={value!r}: {expected}") from None
    try:
        return cls(**converted)
    except LeantrainError:
        raise
    except ValueError as exc:  # a range check in the task itself, already naming the field
        raise LeantrainError(f"task {name!r}: {exc}") from exc


__all__ = [
    "REWARD_PARTS",
    "TASKS",
    "ArithTask",
    "CodeTask",
    "CountdownTask",
    "Example",
    "JsonlTask",
    "RewardWeights",
    "ScoreResult",
    "SentimentTask",
    "Task",
    "ToolArithTask",
    "VisualTask",
    "check_parts",
    "length_stats",
    "make_task",
    "score_safely",
    "total",
]
