"""`code`: answer with a one-line Python program; it is really run, in the sandbox.

    prompt:   "python sum 3 5 2\\n"        response: "print(3+5+2)"
    prompt:   "python product 3 5 2\\n"    response: "print(3*5*2)"
    prompt:   "python max 3 5 2\\n"        response: "print(max(3,5,2))"

Parts: `format` is 1 when the response (stripped) parses as Python; `tool` is 1 only when it then
runs in the sandbox, exits cleanly and prints exactly the right value (stdout stripped).
"""

from __future__ import annotations

import ast
import math
import random
from collections.abc import Callable
from dataclasses import dataclass

from leantrain.errors import LeantrainError
from leantrain.tasks.base import Example, Task
from leantrain.tasks.sandbox import run_python

# operation -> (value of the numbers, the program that prints it)
_OPERATIONS: dict[str, tuple[Callable[[list[int]], int], Callable[[list[str]], str]]] = {
    "sum": (sum, lambda xs: f"print({'+'.join(xs)})"),
    "product": (math.prod, lambda xs: f"print({'*'.join(xs)})"),
    "max": (max, lambda xs: f"print(max({','.join(xs)}))"),
}


def parses(code: str) -> bool:
    """Whether `code` is a non-empty, syntactically valid Python program."""
    if not code.strip():
        return False
    try:
        ast.parse(code)
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        # ValueError: NUL bytes; MemoryError/RecursionError: pathological nesting.
        return False
    return True


@dataclass
class CodeTask(Task):
    """Write a Python one-liner that prints the sum, product or max of a few numbers.

    Attributes:
        operations: which operations prompts ask for (from "sum", "product", "max").
        min_items: fewest numbers.
        max_items: most numbers.
        max_digit: numbers are drawn from 1..max_digit.
        timeout_s: sandbox wall-clock limit per response, from when its code begins.
    """

    operations: tuple[str, ...] = ("sum", "product", "max")
    min_items: int = 2
    max_items: int = 4
    max_digit: int = 9
    timeout_s: float = 2.0
    name: str = "code"
    parts = ("format", "tool")

    def __post_init__(self) -> None:
        unknown = [op for op in self.operations if op not in _OPERATIONS]
        if unknown or not self.operations:
            raise LeantrainError(
                f"code.operations must be a non-empty subset of {list(_OPERATIONS)}, "
                f"got {list(self.operations)}"
            )
        if not 1 <= self.min_items <= self.max_items:
            raise LeantrainError(
                f"code needs 1 <= min_items <= max_items, got {self.min_items}, {self.max_items}"
            )
        if self.max_digit < 1:
            raise LeantrainError(f"code.max_digit must be >= 1, got {self.max_digit}")
        if self.timeout_s <= 0:
            raise LeantrainError(f"code.timeout_s must be > 0, got {self.timeout_s}")

    def sample(self, rng: random.Random) -> Example:
        op = rng.choice(self.operations)
        numbers = [
            rng.randint(1, self.max_digit)
            for _ in range(rng.randint(self.min_items, self.max_items))
        ]
        value, program = _OPERATIONS[op]
        return Example(
            prompt=f"python {op} {' '.join(map(str, numbers))}\n",
            answer=str(value(numbers)),
            solution=program([str(x) for x in numbers]),
            meta={"operation": op, "numbers": numbers},
        )

    def score(self, example: Example, response: str) -> dict[str, float]:
        code = response.strip()
        if not parses(code):
            return {"format": 0.0, "tool": 0.0}
        run = run_python(code, timeout_s=self.timeout_s)
        return {"format": 1.0, "tool": float(run.ok and run.stdout.strip() == example.answer)}
