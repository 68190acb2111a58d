"""Countdown: solvable instances, and a verifier that parses (never evaluates) the answer."""

from __future__ import annotations

import random

import pytest

from leantrain.errors import LeantrainError
from leantrain.tasks.base import Example
from leantrain.tasks.countdown import CountdownTask, evaluate

TASK = CountdownTask()
EXAMPLE = Example(prompt="reach 17 with 3 5 2 7\n", answer="17", meta={"numbers": [3, 5, 2, 7]})


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ("3*5+2=17", {"format": 1.0, "answer": 1.0}),
        ("  (5*2)+7=17\n", {"format": 1.0, "answer": 1.0}),  # spare parentheses are fine
        ("7+5*2=17", {"format": 1.0, "answer": 1.0}),  # not every number is needed
        ("3*5+2=99", {"format": 1.0, "answer": 1.0}),  # the claim after "=" is not checked
        ("3*5+2", {"format": 0.0, "answer": 1.0}),  # right, but no "=target"
        ("let me see\n3*5+2=17", {"format": 0.0, "answer": 1.0}),  # the last line counts
        ("3 * 5 + 2 = 17", {"format": 0.0, "answer": 1.0}),  # spaces break the format only
        ("3*5+3=18", {"format": 1.0, "answer": 0.0}),  # wrong value
        ("7+7+3=17", {"format": 1.0, "answer": 0.0}),  # 7 used twice, given once
        ("15+2=17", {"format": 1.0, "answer": 0.0}),  # 15 is not given
        ("-3+5*2+7+3=17", {"format": 0.0, "answer": 0.0}),  # unary minus is not allowed
        ("3**2+5+3=17", {"format": 0.0, "answer": 0.0}),  # neither is power
        ("(3*5+2=17", {"format": 0.0, "answer": 0.0}),  # unbalanced
        ("__import__('os')=17", {"format": 0.0, "answer": 0.0}),
        ("", {"format": 0.0, "answer": 0.0}),
    ],
)
def test_score(response: str, expected: dict[str, float]) -> None:
    assert TASK.score(EXAMPLE, response) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("3*5+2", (17, [3, 5, 2])),
        ("2-(3-1)", (0, [2, 3, 1])),
        ("(2+3)*4", (20, [2, 3, 4])),
        ("7", (7, [7])),
        ("3/5", None),
        ("3//5", None),
        ("True+1", None),
        ("1.5*2", None),
        ("0x10", None),
        ("x+1", None),
        ("1" * 65, None),  # longer than any sensible answer
        ("(" * 40 + "1" + ")" * 40, None),
        ("", None),
    ],
)
def test_evaluate(text: str, expected: tuple[int, list[int]] | None) -> None:
    assert evaluate(text) == expected


def test_solutions_score_full_marks_and_use_only_given_numbers() -> None:
    for example in TASK.examples(500, seed=1):
        assert TASK.score(example, example.solution or "") == {"format": 1.0, "answer": 1.0}
        numbers = example.meta["numbers"]
        assert example.prompt == f"reach {example.answer} with {' '.join(map(str, numbers))}\n"
        assert 1 <= int(example.answer) <= TASK.max_target
        assert TASK.min_numbers <= len(numbers) <= TASK.max_numbers
        assert all(1 <= x <= TASK.max_number for x in numbers)


def test_parentheses_are_kept_where_needed() -> None:
    # The rendered text must have the value the tree had; a dropped pair would change it.
    task = CountdownTask(min_numbers=4, max_numbers=4, max_number=20, max_target=10**6)
    examples = task.examples(500, seed=2)
    assert any("(" in (ex.solution or "") for ex in examples)
    for example in examples:
        assert task.score(example, example.solution or "")["answer"] == 1.0


def test_same_seed_same_examples() -> None:
    assert TASK.examples(50, seed=3) == TASK.examples(50, seed=3)
    assert TASK.examples(50, seed=3) != TASK.examples(50, seed=4)
    assert TASK.sample(random.Random(5)) == TASK.sample(random.Random(5))


@pytest.mark.parametrize(
    "options",
    [
        {"min_numbers": 1},
        {"min_numbers": 4, "max_numbers": 3},
        {"max_number": 0},
        {"max_target": 1},
    ],
)
def test_bad_options(options: dict[str, int]) -> None:
    with pytest.raises(LeantrainError, match="countdown"):
        CountdownTask(**options)
