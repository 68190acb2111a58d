"""Building tasks by name, and the property every built-in task shares: its worked solutions
score full marks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from leantrain.errors import LeantrainError
from leantrain.tasks import TASKS, ArithTask, JsonlTask, make_task, score_safely

BUILT_IN = sorted(set(TASKS) - {"jsonl"})
# How many random examples to check; the code task runs each solution in the sandbox.
SAMPLES = {
    "arith": 500,
    "countdown": 500,
    "code": 25,
    "sentiment": 500,
    "tool_arith": 500,
    "visual": 200,
}


@pytest.mark.parametrize("name", BUILT_IN)
def test_every_solution_scores_full_marks(name: str) -> None:
    task = make_task(name)
    assert task.name == name
    for example in task.examples(SAMPLES[name], seed=7):
        assert example.solution
        result = score_safely(task, example, example.solution)
        assert result.error is None
        assert set(result.parts) == set(task.parts)
        assert all(value == 1.0 for value in result.parts.values()), (example, result)


@pytest.mark.parametrize("name", BUILT_IN)
def test_prompts_are_short_single_lines(name: str) -> None:
    for example in make_task(name).examples(200, seed=0):
        assert example.prompt.endswith("\n") and example.prompt.count("\n") == 1
        assert len(example.prompt) < 120


def test_options_are_converted_from_strings() -> None:
    task = make_task("arith", alpha="1.5", max_items="8")
    assert task == ArithTask(alpha=1.5, max_items=8)
    assert (
        make_task("code", operations=["max"])
        .examples(5, seed=0)[0]
        .prompt.startswith("python max ")
    )


def test_jsonl_by_name(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"prompt": "p\n", "answer": "a"}) + "\n")
    task = make_task("jsonl", path=str(path))
    assert isinstance(task, JsonlTask)
    assert task.rows[0].answer == "a"


@pytest.mark.parametrize(
    ("name", "options", "message"),
    [
        ("arithmetic", {}, "unknown task 'arithmetic'; known tasks: arith, countdown, code, jsonl"),
        ("arith", {"beta": 1}, "task 'arith' has no option(s) ['beta']; options: alpha,"),
        ("jsonl", {}, "task 'jsonl' needs option(s) ['path']"),
        ("arith", {"alpha": "heavy"}, "task 'arith' option 'alpha'='heavy': Input should be"),
        ("arith", {"max_items": 2.5}, "option 'max_items'"),
        ("arith", {"alpha": -1}, "arith.alpha must be > 0"),
        ("countdown", {"min_numbers": 1}, "countdown needs 2 <= min_numbers"),
        ("code", {"operations": ["div"]}, "code.operations must be"),
    ],
)
def test_bad_names_and_options_are_named(
    name: str, options: dict[str, object], message: str
) -> None:
    with pytest.raises(LeantrainError) as info:
        make_task(name, **options)
    assert message in str(info.value)


def test_the_task_settings_help_names_every_task() -> None:
    from leantrain.tasks import TASKS
    from leantrain.tasks.config import TaskConfig

    help_text = TaskConfig.model_fields["name"].description
    assert all(name in help_text for name in TASKS), help_text
