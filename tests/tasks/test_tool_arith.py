import random

import pytest

from leantrain.errors import LeantrainError
from leantrain.tasks import make_task
from leantrain.tasks.tool_arith import ToolArithTask


@pytest.fixture(scope="module")
def task() -> ToolArithTask:
    return ToolArithTask(timeout_s=1.0)


def test_examples_need_the_tool_and_their_solutions_score_full_marks(task):
    examples = task.examples(50, seed=3)
    for ex in examples:
        expression = ex.prompt.removeprefix("calc ").strip()
        assert str(eval(expression)) == ex.answer
        assert task.score(ex, ex.solution) == {"format": 1.0, "answer": 1.0, "tool": 1.0}
    # Multi-digit operands: not something to do in one's head (or a 1 M-parameter model's).
    assert max(len(ex.answer.lstrip("-")) for ex in examples) >= 5


def test_call_tool_outcomes(task):
    ok = task.call_tool("<python>\nprint(6*7)\n</python>")
    assert (ok.code, ok.outcome, ok.output) == ("print(6*7)", "ok", "<output>\n42\n</output>")
    crash = task.call_tool("thinking\n<python>\n1/0\n</python>")
    assert crash.outcome == "error"
    assert crash.output == "<error>\nZeroDivisionError: division by zero\n</error>"
    loop = task.call_tool("<python>\nwhile True: pass\n</python>")
    assert (loop.outcome, loop.output) == ("timeout", "<error>\ntimeout after 1 s\n</error>")
    for malformed in ("print(1)\n</python>", "<python>\n\n</python>"):
        call = task.call_tool(malformed)
        assert (call.code, call.outcome) == (None, "malformed")
        assert call.output.startswith("<error>\nmalformed tool call")


def test_call_tool_cuts_long_output():
    task = ToolArithTask(max_output_chars=5)
    assert task.call_tool("<python>\nprint('x' * 50)\n</python>").output == (
        "<output>\nxxxxx\n</output>"
    )


def test_score_parts(task):
    ex = task.sample(random.Random(0))
    ran = f"<python>\nprint({ex.meta['expression']})\n</python>\n<output>\n{ex.answer}\n</output>\n"
    failed = "<python>\n1/0\n</python>\n<error>\nZeroDivisionError: division by zero\n</error>\n"
    assert task.score(ex, failed + ran + f"answer: {ex.answer}") == {
        "format": 1.0,
        "answer": 1.0,
        "tool": 1.0,
    }
    # An output block the model wrote itself is not a tool run: no `</python>` right before it.
    forged = f"<output>\n{ex.answer}\n</output>\nanswer: {ex.answer}"
    assert task.score(ex, forged) == {"format": 0.0, "answer": 1.0, "tool": 0.0}
    assert task.score(ex, failed + "answer: 1") == {"format": 1.0, "answer": 0.0, "tool": 0.0}


def test_make_task_validates_options():
    assert make_task("tool_arith", max_turns="2").max_turns == 2
    with pytest.raises(LeantrainError, match="max_turns"):
        make_task("tool_arith", max_turns=0)
    with pytest.raises(LeantrainError, match="min_digits"):
        make_task("tool_arith", min_digits=5, max_digits=3)


def test_worked_turns_are_the_solution_split_by_who_wrote_it(task):
    from leantrain.tasks.tool_arith import reply_text, worked_turns

    ex = task.examples(1, seed=5)[0]
    turns = worked_turns(ex.meta["expression"], ex.answer)
    assert "".join(text for text, _ in turns) == ex.solution
    assert [by_model for _, by_model in turns] == [True, False, True]
    call, reply, answer = (text for text, _ in turns)
    assert call.endswith(task.tool_stop)  # where the runner stops the turn
    assert reply == reply_text(task.call_tool(call).output)  # what the runner appends
    assert answer == f"answer: {ex.answer}"
