"""The code task: a snippet earns `tool` only if it really runs and prints the right value."""

from __future__ import annotations

import re

import pytest

from leantrain.errors import LeantrainError
from leantrain.tasks.base import Example
from leantrain.tasks.code import CodeTask, parses

TASK = CodeTask()
EXAMPLE = Example(
    prompt="python sum 3 5 2\n", answer="10", meta={"operation": "sum", "numbers": [3, 5, 2]}
)


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ("print(3+5+2)", {"format": 1.0, "tool": 1.0}),
        ("\nprint(sum([3, 5, 2]))\n", {"format": 1.0, "tool": 1.0}),
        ("x = 3 + 5\nprint(x + 2)", {"format": 1.0, "tool": 1.0}),
        ("print(3+5+3)", {"format": 1.0, "tool": 0.0}),  # runs, wrong value
        ("print('10', 'and more')", {"format": 1.0, "tool": 0.0}),
        ("10", {"format": 1.0, "tool": 0.0}),  # valid Python that prints nothing
        ("print(10)\n1/0", {"format": 1.0, "tool": 0.0}),  # right output, then crashes
        ("print(undefined)", {"format": 1.0, "tool": 0.0}),
        ("while True: pass", {"format": 1.0, "tool": 0.0}),  # killed at the timeout
        ("print(3+5+2", {"format": 0.0, "tool": 0.0}),
        ("3+5+2=10", {"format": 0.0, "tool": 0.0}),
        ("", {"format": 0.0, "tool": 0.0}),
    ],
)
def test_score(response: str, expected: dict[str, float]) -> None:
    assert CodeTask(timeout_s=1.0).score(EXAMPLE, response) == expected


def test_parses() -> None:
    assert parses("print(1)")
    assert not parses("   ")
    assert not parses("print(1")
    assert not parses("print(1)\x00")
    assert not parses("(" * 10_000)


def test_prompts_and_solutions_for_each_operation() -> None:
    shapes = {
        "sum": r"print\(\d(\+\d)+\)",
        "product": r"print\(\d(\*\d)+\)",
        "max": r"print\(max\(\d(,\d)+\)\)",
    }
    examples = TASK.examples(200, seed=0)
    assert {ex.meta["operation"] for ex in examples} == set(shapes)
    for example in examples:
        op, numbers = example.meta["operation"], example.meta["numbers"]
        assert example.prompt == f"python {op} {' '.join(map(str, numbers))}\n"
        assert re.fullmatch(shapes[op], example.solution or "")
        assert re.findall(r"\d", example.solution or "") == [str(x) for x in numbers]


def test_solutions_really_run_and_score_full_marks() -> None:
    for example in TASK.examples(30, seed=1):
        assert TASK.score(example, example.solution or "") == {"format": 1.0, "tool": 1.0}


def test_same_seed_same_examples() -> None:
    assert TASK.examples(50, seed=2) == TASK.examples(50, seed=2)


@pytest.mark.parametrize(
    "options",
    [
        {"operations": ("div",)},
        {"operations": ()},
        {"min_items": 0},
        {"max_digit": 0},
        {"timeout_s": 0},
    ],
)
def test_bad_options(options: dict[str, object]) -> None:
    with pytest.raises(LeantrainError, match="code"):
        CodeTask(**options)  # type: ignore[arg-type]
