"""Dataset rows: every bad row is listed with its line number and reason, never dropped."""

from __future__ import annotations

import pytest

from leantrain.data.rows import read_rows
from leantrain.errors import LeantrainError


def test_bad_rows_are_listed_by_line_and_valid_rows_kept(tmp_path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text(
        '{"prompt": "a", "answer": "b", "source": "s1"}\n'
        "{not json\n"
        '{"prompt": "a"}\n'
        "\n"
        "[1, 2]\n"
        '{"prompt": " ", "answer": ""}\n'
        '{"prompt": "x", "answer": 3}\n'
        '{"prompt": "c", "answer": "d"}\n'
        '{"prompt": "e", "answer": " "}\n'
    )
    raw, rows, bad = read_rows(path)
    assert len(raw) == 9
    assert [(r.line, r.prompt, r.answer, r.source) for r in rows] == [
        (1, "a", "b", "s1"),
        (8, "c", "d", "default"),
    ]
    reasons = {b.line: b.reason for b in bad}
    assert sorted(reasons) == [2, 3, 4, 5, 6, 7, 9]
    assert reasons[2].startswith("invalid JSON")
    assert reasons[3] == "missing field 'answer'"
    assert reasons[4] == "blank line"
    assert reasons[5] == "expected a JSON object, got list"
    assert reasons[6].startswith("empty text")
    assert reasons[7] == "field 'answer' must be a string, got int"
    assert reasons[9].startswith("empty answer")


def test_a_file_without_valid_rows_is_a_user_error(tmp_path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text("{oops\n")
    with pytest.raises(LeantrainError, match=r"no valid rows.*line 1: invalid JSON"):
        read_rows(path)
