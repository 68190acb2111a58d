"""`countdown`: reach a target from a few small numbers with + - * and parentheses, each number
used at most as often as it is given. Every instance is solvable: the target is the value of a
random expression over some of the numbers, and that expression is the worked solution.

    prompt:   "reach 17 with 3 5 2 7\\n"
    response: "3*5+2=17"

The verifier never evaluates text: it parses it with `ast` and walks a tree that may hold only
integer literals, + - * and parentheses.
"""

from __future__ import annotations

import ast
import operator
import random
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from leantrain.errors import LeantrainError
from leantrain.tasks.base import Example, Task

_FORMAT = re.compile(r"[\d+\-*()]+=-?\d+")
_CHARS = re.compile(r"[\d+\-*() ]+")
# Longer than any sensible answer to a 4-number instance, short enough that parsing and big-int
# arithmetic on whatever a policy writes stay cheap.
_MAX_CHARS = 64
_APPLY: dict[str, Callable[[int, int], int]] = {
    "+": operator.add,
    "-": operator.sub,
    "*": operator.mul,
}
_SYMBOL: dict[type[ast.operator], str] = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*"}
_PRECEDENCE = {"+": 1, "-": 1, "*": 2}
_LEAF = 3  # binds tighter than any operator: a number never needs parentheses


def evaluate(text: str) -> tuple[int, list[int]] | None:
    """The value of an arithmetic expression and the numbers it uses, in order.

    None unless `text` is made only of non-negative integer literals, + - * and parentheses (no
    unary minus, no other operators, names or calls).
    """
    text = text.strip()
    if len(text) > _MAX_CHARS or not _CHARS.fullmatch(text):
        return None
    try:
        tree = ast.parse(text, mode="eval").body
    except SyntaxError:
        return None
    numbers: list[int] = []
    value = _walk(tree, numbers)
    return None if value is None else (value, numbers)


def _walk(node: ast.expr, numbers: list[int]) -> int | None:
    """Evaluate an allowed tree, appending its literals to `numbers`; None at any other node."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        numbers.append(node.value)
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _SYMBOL:
        left, right = _walk(node.left, numbers), _walk(node.right, numbers)
        if left is None or right is None:
            return None
        return _APPLY[_SYMBOL[type(node.op)]](left, right)
    return None


def _random_expression(numbers: list[int], rng: random.Random) -> tuple[str, int, int]:
    """A random binary tree over `numbers` (in this order) as (text, value, precedence); the text
    has only the parentheses the precedence of + - * needs."""
    if len(numbers) == 1:
        return str(numbers[0]), numbers[0], _LEAF
    cut = rng.randint(1, len(numbers) - 1)
    left, left_value, left_prec = _random_expression(numbers[:cut], rng)
    right, right_value, right_prec = _random_expression(numbers[cut:], rng)
    op = rng.choice("+-*")
    prec = _PRECEDENCE[op]
    if left_prec < prec:
        left = f"({left})"
    # a-(b+c) and a-(b-c) keep their parentheses; + and * are associative, so a+(b-c) = a+b-c.
    if right_prec < prec or (right_prec == prec and op == "-"):
        right = f"({right})"
    return f"{left}{op}{right}", _APPLY[op](left_value, right_value), prec


@dataclass
class CountdownTask(Task):
    """Reach a target from 3-4 small numbers.

    Attributes:
        min_numbers: fewest numbers given.
        max_numbers: most numbers given.
        max_number: numbers are drawn from 1..max_number.
        max_target: targets lie in 1..max_target (keeps them short for a byte-level model).
    """

    min_numbers: int = 3
    max_numbers: int = 4
    max_number: int = 9
    max_target: int = 99
    name: str = "countdown"
    parts = ("format", "answer")

    def __post_init__(self) -> None:
        if not 2 <= self.min_numbers <= self.max_numbers:
            raise LeantrainError(
                "countdown needs 2 <= min_numbers <= max_numbers, "
                f"got {self.min_numbers}, {self.max_numbers}"
            )
        if self.max_number < 1:
            raise LeantrainError(f"countdown.max_number must be >= 1, got {self.max_number}")
        if self.max_target < 2:  # 1+1 must fit, or sampling might never find a target
            raise LeantrainError(f"countdown.max_target must be >= 2, got {self.max_target}")

    def sample(self, rng: random.Random) -> Example:
        while True:  # redraw everything until the target is in range; 1+1 always can be
            count = rng.randint(self.min_numbers, self.max_numbers)
            numbers = [rng.randint(1, self.max_number) for _ in range(count)]
            used = rng.sample(numbers, rng.randint(2, count))
            expression, target, _ = _random_expression(used, rng)
            if 1 <= target <= self.max_target:
                break
        return Example(
            prompt=f"reach {target} with {' '.join(map(str, numbers))}\n",
            answer=str(target),
            solution=f"{expression}={target}",
            meta={"numbers": numbers},
        )

    def score(self, example: Example, response: str) -> dict[str, float]:
        text = response.strip()
        lines = text.splitlines() or [""]
        # The expression is what stands before "=" on the last line; what follows is a claim.
        expression = lines[-1].partition("=")[0]
        result = evaluate(expression)
        correct = (
            result is not None
            and result[0] == int(example.answer)
            and not Counter(result[1]) - Counter(example.meta["numbers"])
        )
        return {
            "format": float(_FORMAT.fullmatch(text) is not None and result is not None),
            "answer": float(correct),
        }
