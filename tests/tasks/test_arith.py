"""Arith: the verifier, determinism, and the heavy tail of its solution lengths."""

from __future__ import annotations

import pytest

from leantrain.tasks.arith import ArithTask
from leantrain.tasks.base import Example, length_stats

TASK = ArithTask()
EXAMPLE = Example(prompt="sum 3 5 2 7\n", answer="17")


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ("3+5=8\n8+2=10\n10+7=17\nanswer: 17", {"format": 1.0, "answer": 1.0}),
        ("answer: 17", {"format": 1.0, "answer": 1.0}),
        ("3+5=8\nanswer: 16", {"format": 1.0, "answer": 0.0}),
        ("the sum is\nanswer: 17", {"format": 0.0, "answer": 1.0}),
        ("answer: 12\nanswer: 17", {"format": 0.0, "answer": 1.0}),  # the last answer counts
        ("17", {"format": 0.0, "answer": 0.0}),
        ("", {"format": 0.0, "answer": 0.0}),
    ],
)
def test_score(response: str, expected: dict[str, float]) -> None:
    assert TASK.score(EXAMPLE, response) == expected


def test_solutions_score_full_marks() -> None:
    for example in TASK.examples(1000, seed=0):
        assert TASK.score(example, example.solution or "") == {"format": 1.0, "answer": 1.0}
        numbers = [int(x) for x in example.prompt.split()[1:]]
        assert int(example.answer) == sum(numbers)


def test_same_seed_same_examples() -> None:
    assert TASK.examples(100, seed=1) == TASK.examples(100, seed=1)
    assert TASK.examples(100, seed=1) != TASK.examples(100, seed=2)


def test_solution_lengths_are_heavy_tailed() -> None:
    stats = length_stats(TASK, n=5000, seed=0)
    assert stats["p50"] <= stats["p90"] <= stats["p99"] <= stats["max"]
    assert stats["p99"] > 3 * stats["p50"]
    # The cap on the list length bounds the tail: 31 steps of at most "288+9=297\n".
    assert stats["max"] <= 31 * 10 + len("answer: 288")


CHAT = ArithTask(style="chat", min_items=2, max_items=3)
CHAT_EXAMPLE = Example(prompt="What is 3 + 5 + 2? Reply with only the number.", answer="10")


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ("10", {"format": 1.0, "answer": 1.0}),
        (" 10.\n", {"format": 1.0, "answer": 1.0}),
        ("3 + 5 + 2 = 10", {"format": 0.0, "answer": 1.0}),  # explained: answer only
        ("The answer is 10.", {"format": 0.0, "answer": 1.0}),
        ("3 + 5 + 2 = 10\n\nThis is 4 more than 6.", {"format": 0.0, "answer": 0.0}),  # last
        ("11", {"format": 1.0, "answer": 0.0}),
        ("-10", {"format": 1.0, "answer": 0.0}),
        ("ten", {"format": 0.0, "answer": 0.0}),
        ("", {"format": 0.0, "answer": 0.0}),
    ],
)
def test_chat_score(response: str, expected: dict[str, float]) -> None:
    assert CHAT.score(CHAT_EXAMPLE, response) == expected


def test_chat_prompts_ask_the_same_sums() -> None:
    """The chat style draws the same numbers as the worked style from the same seed, asks them
    as a question, and its solution (the number alone) scores full marks."""
    worked = ArithTask(min_items=2, max_items=3).examples(300, seed=0)
    chat = CHAT.examples(300, seed=0)
    for w, c in zip(worked, chat, strict=True):
        numbers = [int(x) for x in w.prompt.split()[1:]]
        assert c.prompt == f"What is {' + '.join(map(str, numbers))}? Reply with only the number."
        assert c.answer == w.answer == str(sum(numbers))
        assert CHAT.score(c, c.solution or "") == {"format": 1.0, "answer": 1.0}
    assert {len(c.prompt.split("+")) for c in chat} == {2, 3}
