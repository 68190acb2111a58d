"""`arith`: sum a list of digits. The list length is heavy-tailed (Pareto), so the worked
solutions, and the responses a policy writes, have a real long tail.

Two styles of the same problems:

- `worked` (the built-in tiny models, trained on this format from scratch):

      prompt:   "sum 3 5 2 7\n"
      response: "3+5=8\n8+2=10\n10+7=17\nanswer: 17"

- `chat` (a pretrained instruct model, through its chat template): a question in plain words that
  asks for the number alone; the answer is the last integer of the response, so a model that
  explains first is not penalised on `answer`, only on `format`.

      prompt:   "What is 3 + 5 + 2 + 7? Reply with only the number."
      response: "17"
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Literal

from leantrain.tasks.base import Example, Task

_FORMAT = re.compile(r"(?:\d+\+\d+=\d+\n)*answer: -?\d+")
_ANSWER = re.compile(r"answer:\s*(-?\d+)")
_CHAT_FORMAT = re.compile(r"-?\d+\.?")
_INTEGER = re.compile(r"-?\d+")


@dataclass
class ArithTask(Task):
    """Running-sum arithmetic with a Pareto-distributed list length.

    Attributes:
        alpha: Pareto shape of the list length; smaller means a heavier tail.
        min_items: shortest list.
        max_items: longest list (the tail is cut here).
        max_digit: numbers are drawn from 1..max_digit.
        style: `worked` (terse prompt, step-by-step response ending in `answer: N`) or `chat`
            (a plain question asking for the number alone, for instruct models).
    """

    alpha: float = 1.0
    min_items: int = 3
    max_items: int = 32
    max_digit: int = 9
    style: Literal["worked", "chat"] = "worked"
    name: str = "arith"
    parts = ("format", "answer")

    def __post_init__(self) -> None:
        if self.alpha <= 0:
            raise ValueError(f"arith.alpha must be > 0, got {self.alpha}")
        if not 2 <= self.min_items <= self.max_items:
            raise ValueError(
                f"arith needs 2 <= min_items <= max_items, got {self.min_items}, {self.max_items}"
            )
        if self.max_digit < 1:
            raise ValueError(f"arith.max_digit must be >= 1, got {self.max_digit}")

    def sample(self, rng: random.Random) -> Example:
        length = min(self.max_items, self.min_items - 1 + int(rng.paretovariate(self.alpha)))
        numbers = [rng.randint(1, self.max_digit) for _ in range(length)]
        steps, total = [], numbers[0]
        for x in numbers[1:]:
            steps.append(f"{total}+{x}={total + x}")
            total += x
        if self.style == "chat":
            prompt = f"What is {' + '.join(map(str, numbers))}? Reply with only the number."
            solution = str(total)
        else:
            prompt = "sum " + " ".join(map(str, numbers)) + "\n"
            solution = "\n".join([*steps, f"answer: {total}"])
        return Example(prompt=prompt, answer=str(total), solution=solution, meta={"n": length})

    def score(self, example: Example, response: str) -> dict[str, float]:
        text = response.strip()
        if self.style == "chat":
            integers = _INTEGER.findall(text)
            return {
                "format": float(_CHAT_FORMAT.fullmatch(text) is not None),
                "answer": float(bool(integers) and integers[-1] == example.answer),
            }
        found = _ANSWER.findall(text)
        return {
            "format": float(_FORMAT.fullmatch(text) is not None),
            "answer": float(bool(found) and found[-1] == example.answer),
        }
