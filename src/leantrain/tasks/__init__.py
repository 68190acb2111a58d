"""Verifiable tasks (prompt generator + verifier) and reward functions."""

from leantrain.tasks.arith import ArithTask
from leantrain.tasks.base import REWARD_PARTS, Example, Task

__all__ = ["REWARD_PARTS", "ArithTask", "Example", "Task"]
