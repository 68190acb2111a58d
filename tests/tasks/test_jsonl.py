"""JSONL tasks: rows checked with line numbers, user reward functions resolved and called."""

from __future__ import annotations

import json
import random
import textwrap
from pathlib import Path

import pytest

from leantrain.errors import LeantrainError
from leantrain.tasks.jsonl import JsonlTask
from leantrain.tasks.rewards import score_safely

REWARDS = """
def contains(prompt, response, answer, **meta):
    return float(answer in response)

def parts(prompt, response, answer, **meta):
    return {"format": float(response.startswith("A:")), "answer": float(response.endswith(answer))}

def strict(response):
    return 1.0

def needs_reference(response, reference):
    return float(response == reference)

def weighted(response, answer, weight, **meta):
    return weight * float(response == answer)

def broken(**kwargs):
    raise RuntimeError("reward crashed")

def wrong_type(**kwargs):
    return "1"

NOT_CALLABLE = 3
"""


@pytest.fixture
def rewards_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A user reward module, importable for this test only."""
    (tmp_path / "user_rewards_for_test.py").write_text(REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "user_rewards_for_test"


def write_rows(path: Path, *rows: object) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture
def qa_file(tmp_path: Path) -> Path:
    return write_rows(
        tmp_path / "qa.jsonl",
        {"prompt": "capital of France?\n", "answer": "Paris", "weight": 0.5},
        {"prompt": "2+2?\n", "answer": "4", "solution": "2+2=4\n4"},
        {"prompt": "colour of the sky?\n", "answer": "blue", "weight": 1.0, "source": "me"},
    )


def test_rows_load_in_file_order_with_meta(qa_file: Path) -> None:
    task = JsonlTask(qa_file)
    assert [row.answer for row in task.rows] == ["Paris", "4", "blue"]
    assert task.rows[0].meta == {"weight": 0.5}
    assert task.rows[1].solution == "2+2=4\n4"
    assert task.rows[2].meta == {"weight": 1.0, "source": "me"}


def test_sample_draws_rows_deterministically(qa_file: Path) -> None:
    task = JsonlTask(str(qa_file))
    assert task.examples(20, seed=0) == task.examples(20, seed=0)
    assert {ex.answer for ex in task.examples(50, seed=0)} == {"Paris", "4", "blue"}
    assert task.sample(random.Random(1)) in task.rows


def test_default_scorer_matches_the_last_line(qa_file: Path) -> None:
    task = JsonlTask(qa_file)
    paris = task.rows[0]
    assert task.parts == ("answer",)
    assert task.score(paris, "I think\n  Paris \n") == {"answer": 1.0}
    assert task.score(paris, "Paris\nor maybe Lyon") == {"answer": 0.0}
    assert task.score(paris, "") == {"answer": 0.0}


def test_a_number_goes_to_answer_or_the_named_part(qa_file: Path, rewards_module: str) -> None:
    task = JsonlTask(qa_file, (f"{rewards_module}:contains", f"format={rewards_module}:strict"))
    assert task.parts == ("answer", "format")
    assert task.score(task.rows[0], "It is Paris.") == {"answer": 1.0, "format": 1.0}
    assert task.score(task.rows[0], "Lyon") == {"answer": 0.0, "format": 1.0}


def test_a_dict_gives_several_parts(qa_file: Path, rewards_module: str) -> None:
    task = JsonlTask(qa_file, (f"{rewards_module}:parts",))
    assert task.score(task.rows[1], "A: 4") == {"format": 1.0, "answer": 1.0}
    assert task.score(task.rows[1], "5") == {"format": 0.0, "answer": 0.0}


def test_extra_fields_reach_the_function(qa_file: Path, rewards_module: str) -> None:
    task = JsonlTask(qa_file, (f"{rewards_module}:weighted",))
    assert task.score(task.rows[0], "Paris") == {"answer": 0.5}


def test_a_function_gets_only_the_arguments_it_names(qa_file: Path, rewards_module: str) -> None:
    task = JsonlTask(qa_file, (f"{rewards_module}:strict",))
    assert task.score(task.rows[0], "anything") == {"answer": 1.0}


@pytest.mark.parametrize(
    ("function", "message"),
    [
        ("broken", "RuntimeError: reward crashed"),
        ("wrong_type", "user_rewards_for_test:wrong_type returned answer='1'"),
        ("needs_reference", "TypeError"),  # the row has no field "reference"
    ],
)
def test_a_failing_function_is_recorded_not_raised(
    qa_file: Path, rewards_module: str, function: str, message: str
) -> None:
    task = JsonlTask(qa_file, (f"{rewards_module}:{function}",))
    result = score_safely(task, task.rows[0], "Paris")
    assert result.parts == {"answer": 0.0}
    assert result.total == 0.0
    assert result.error is not None and message in result.error


def test_two_functions_may_not_score_one_part(qa_file: Path, rewards_module: str) -> None:
    with pytest.raises(
        LeantrainError, match=r"more than one function scores part\(s\) \['answer'\]"
    ):
        JsonlTask(qa_file, (f"{rewards_module}:contains", f"{rewards_module}:strict"))
    task = JsonlTask(qa_file, (f"{rewards_module}:parts", f"format={rewards_module}:strict"))
    result = score_safely(task, task.rows[0], "Paris")
    assert result.error is not None and "already scored" in result.error


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no_such_module_xyz:f", "cannot import 'no_such_module_xyz'"),
        ("{m}:missing", "has no 'missing'"),
        ("{m}:NOT_CALLABLE", "is not callable"),
        ("{m}", "expected [part=]module:function"),
        ("speed={m}:contains", "part 'speed' is not one of"),
    ],
)
def test_unresolvable_functions_are_named(
    qa_file: Path, rewards_module: str, spec: str, message: str
) -> None:
    spec = spec.format(m=rewards_module)
    with pytest.raises(LeantrainError) as info:
        JsonlTask(qa_file, (spec,))
    assert repr(spec) in str(info.value)
    assert message in str(info.value)


def test_every_bad_row_is_reported_with_its_line_number(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_bytes(
        textwrap.dedent(
            """\
            {"prompt": "ok\\n", "answer": "1"}
            {"prompt": "no answer"}

            not json
            [1, 2]
            {"prompt": 3, "answer": "x"}
            {"prompt": "p", "answer": "a", "response": "r"}
            {"prompt": "p", "answer": "a", "solution": 7}
            """
        ).encode()
        + b'{"prompt": "\xff", "answer": "a"}\n'
    )
    with pytest.raises(LeantrainError) as info:
        JsonlTask(path)
    message = str(info.value)
    assert "7 bad row(s)" in message
    for expected in [
        "line 2: missing field 'answer'",
        "line 4: invalid JSON",
        "line 5: expected a JSON object, got list",
        "line 6: field 'prompt' must be a string, got int",
        "line 7: field 'response' is reserved",
        "line 8: field 'solution' must be a string, got int",
        "line 9: not UTF-8",
    ]:
        assert expected in message
    assert "line 1:" not in message and "line 3:" not in message


@pytest.mark.parametrize("content", ["", "\n  \n"])
def test_an_empty_file_is_an_error(tmp_path: Path, content: str) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text(content)
    with pytest.raises(LeantrainError, match="no rows"):
        JsonlTask(path)


def test_a_missing_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(LeantrainError, match="cannot read task file"):
        JsonlTask(tmp_path / "nope.jsonl")
