"""Dataset rows for valuation: one JSON object per line with string fields `prompt` and
`answer` and an optional string `source` (who supplied the row; default `default`). A bad row
(invalid JSON, not an object, a missing or non-string field, empty text or answer) is kept in a
list with its line number and reason, and skipped; nothing is dropped silently. Blank lines are
skipped too, and listed, since the Merkle commitment still covers them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from leantrain.data.merkle import file_rows
from leantrain.errors import LeantrainError
from leantrain.tasks.jsonl import field_problems, json_object

DEFAULT_SOURCE = "default"


@dataclass(frozen=True)
class Row:
    """One valid row; `line` is its 1-based line number in the file (its Merkle index + 1)."""

    line: int
    prompt: str
    answer: str
    source: str


@dataclass(frozen=True)
class BadRow:
    line: int
    reason: str


def parse_row(line: int, raw: bytes) -> Row:
    """One line as a Row, or a ValueError saying what is wrong with it."""
    if not raw.strip():
        raise ValueError("blank line")
    obj = json_object(raw)
    problems = field_problems(obj, ("prompt", "answer"), ("prompt", "answer", "source"))
    if problems:
        raise ValueError(", ".join(problems))
    if not (obj["prompt"] + obj["answer"]).strip():
        raise ValueError("empty text (prompt and answer are both blank)")
    if not obj["answer"].strip():
        raise ValueError("empty answer (nothing the model would train on, nothing to value)")
    source = obj.get("source", DEFAULT_SOURCE).strip() or DEFAULT_SOURCE
    return Row(line, obj["prompt"], obj["answer"], source)


def read_rows(path: Path) -> tuple[list[bytes], list[Row], list[BadRow]]:
    """The file's raw lines (what the Merkle tree commits to), its valid rows and its bad rows.
    A LeantrainError if the file cannot be read or has no valid row at all."""
    raw = file_rows(path)
    rows, bad = [], []
    for number, line in enumerate(raw, start=1):
        try:
            rows.append(parse_row(number, line))
        except ValueError as exc:
            bad.append(BadRow(number, str(exc)))
    if not rows:
        reasons = "; ".join(f"line {b.line}: {b.reason}" for b in bad[:5])
        raise LeantrainError(
            f"{path}: no valid rows (expected JSON objects with string prompt and answer)"
            + (f"; {reasons}" if reasons else "")
        )
    return raw, rows, bad
