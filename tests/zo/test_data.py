"""Training rows from tasks and from the user's own JSONL."""

from __future__ import annotations

from pathlib import Path

import pytest

from leantrain.errors import LeantrainError
from leantrain.models.finetune import IGNORE
from leantrain.models.tokenizer import build_byte_tokenizer
from leantrain.zo.data import Pair, pad_pairs, read_pairs, sample_batch

TOKENIZER = build_byte_tokenizer()


def test_pairs_and_text_rows(tmp_path: Path) -> None:
    path = tmp_path / "mine.jsonl"
    path.write_text(
        '{"prompt": "Q?\\n", "completion": "yes"}\n\n{"text": "abcdefghij"}\n', encoding="utf-8"
    )
    pairs = read_pairs(path, TOKENIZER, max_tokens=4)
    first = pairs[0]
    assert TOKENIZER.decode(first.prompt) == "Q?\n"
    assert first.completion == [*TOKENIZER.encode("yes"), TOKENIZER.eos_token_id]
    # 10 text tokens in windows of 4: abcd, efgh, ij; all of it is completion (LM loss).
    assert [TOKENIZER.decode(p.completion) for p in pairs[1:]] == ["abcd", "efgh", "ij"]
    assert all(p.prompt == [] for p in pairs[1:])


def test_bad_rows_are_all_reported_with_line_numbers(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(
        '{"prompt": "ok", "completion": "fine"}\n'
        "not json\n"
        '["a list"]\n'
        '{"prompt": "no completion"}\n'
        '{"text": ""}\n'
        '{"text": "t", "prompt": "p"}\n'
    )
    with pytest.raises(LeantrainError) as err:
        read_pairs(path, TOKENIZER, max_tokens=16)
    message = str(err.value)
    assert "5 bad row(s)" in message
    for line in (2, 3, 4, 5, 6):
        assert f"line {line}:" in message
    assert "line 1:" not in message
    assert "missing field 'completion'" in message


def test_empty_or_missing_files_are_errors(tmp_path: Path) -> None:
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(LeantrainError, match="no rows"):
        read_pairs(tmp_path / "empty.jsonl", TOKENIZER, 16)
    with pytest.raises(LeantrainError, match="cannot read"):
        read_pairs(tmp_path / "absent.jsonl", TOKENIZER, 16)


def test_pad_pairs_labels_only_completions() -> None:
    ids, labels = pad_pairs([Pair([5, 6], [7]), Pair([8], [9, 10, 11])], pad_id=0)
    assert ids.tolist() == [[5, 6, 7, 0], [8, 9, 10, 11]]
    assert labels.tolist() == [[IGNORE, IGNORE, 7, IGNORE], [IGNORE, 9, 10, 11]]


def test_sample_batch_is_seeded() -> None:
    pairs = [Pair([i], [i]) for i in range(10)]
    assert sample_batch(pairs, 4, 1) == sample_batch(pairs, 4, 1)
    assert len(set(map(id, sample_batch(pairs, 4, 1)))) == 4
    assert len(sample_batch(pairs, 25, 1)) == 25  # more than there are: with replacement
