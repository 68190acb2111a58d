"""The sentiment task: labels follow the majority polarity with negations, and scoring reads the
first word of the response."""

from __future__ import annotations

import random

import pytest

from leantrain.errors import LeantrainError
from leantrain.tasks import make_task
from leantrain.tasks.sentiment import _NEGATIVE, _POSITIVE, SentimentTask


def _polarity(prompt: str) -> int:
    opinion = prompt.split(" was ", 1)[1].split(".\n")[0].replace(",", "").replace(" and", "")
    words, total, negate = opinion.split(), 0, False
    for word in words:
        if word == "not":
            negate = True
            continue
        sign = 1 if word in _POSITIVE else -1 if word in _NEGATIVE else 0
        assert sign != 0, word
        total += -sign if negate else sign
        negate = False
    return total


def test_label_is_majority_polarity_with_negation() -> None:
    task = SentimentTask()
    examples = task.examples(500, seed=3)
    for ex in examples:
        assert ex.answer == ("positive" if _polarity(ex.prompt) > 0 else "negative")
    share = sum(ex.answer == "positive" for ex in examples) / len(examples)
    assert 0.4 < share < 0.6
    assert any("not " in ex.prompt for ex in examples)


def test_same_seed_same_examples() -> None:
    assert SentimentTask().examples(20, 7) == SentimentTask().examples(20, 7)


def test_score_reads_first_word() -> None:
    task = SentimentTask()
    ex = task.sample(random.Random(0))
    other = "negative" if ex.answer == "positive" else "positive"
    assert task.score(ex, f" {ex.answer}.") == {"answer": 1.0}
    assert task.score(ex, f" {other} {ex.answer}") == {"answer": 0.0}
    assert task.score(ex, "") == {"answer": 0.0}


def test_bad_options_named() -> None:
    with pytest.raises(LeantrainError, match="max_words"):
        make_task("sentiment", max_words=2)
