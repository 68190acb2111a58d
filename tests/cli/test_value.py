"""`leantrain value` and `leantrain value verify`: exit 0 when a file matches its commitment,
1 when it was tampered with (naming the lines), 2 for user errors; one real tiny run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from leantrain.cli import app
from leantrain.data.merkle import MerkleTree, file_rows
from leantrain.tasks import make_task

runner = CliRunner()


@pytest.fixture
def committed(tmp_path: Path) -> tuple[Path, Path, str]:
    """A 6-line file, its proofs.jsonl and root, as `leantrain value` writes them."""
    data = tmp_path / "rows.jsonl"
    data.write_text(
        "".join(json.dumps({"prompt": f"p{i}", "answer": "a"}) + "\n" for i in range(6))
    )
    tree = MerkleTree(file_rows(data))
    proofs = tmp_path / "proofs.jsonl"
    proofs.write_text(
        "".join(json.dumps({"line": i + 1, **tree.proof(i).to_json()}) + "\n" for i in range(6))
    )
    return data, proofs, tree.root


def verify(*args: str):
    return runner.invoke(app, ["value", "verify", *args])


def test_verify_accepts_the_committed_file_and_each_line(committed) -> None:
    data, proofs, root = committed
    result = verify("--data", str(data), "--root", root)
    assert result.exit_code == 0 and "all 6 lines verified" in result.output
    result = verify("--data", str(data), "--root", root, "--proofs", str(proofs), "--line", "4")
    assert result.exit_code == 0 and "line 4" in result.output and "verified" in result.output


@pytest.mark.parametrize(
    "tamper,expected",
    [
        (lambda rows: [*rows[:2], rows[2].replace("p2", "p9"), *rows[3:]], ["line 3 is not"]),
        (lambda rows: [rows[1], rows[0], *rows[2:]], ["line 1 is not", "line 2 is not"]),
        (lambda rows: rows[:-1], ["5 lines, the commitment 6"]),
        (lambda rows: [*rows, rows[0]], ["7 lines, the commitment 6"]),
        (lambda rows: rows[1:], ["line 1 is not", "line 5 is not", "5 lines"]),
    ],
    ids=["changed", "reordered", "removed", "added", "removed-first"],
)
def test_verify_names_what_was_tampered_with(committed, tamper, expected) -> None:
    data, proofs, root = committed
    data.write_text("\n".join(tamper(data.read_text().splitlines())) + "\n")
    result = verify("--data", str(data), "--root", root, "--proofs", str(proofs))
    assert result.exit_code == 1
    assert "root differs" in result.output
    for text in expected:
        assert text in result.output
    if "line 3 is not" in expected:
        line = verify("--data", str(data), "--root", root, "--proofs", str(proofs), "--line", "3")
        assert line.exit_code == 1 and "NOT line 3" in line.output


def test_verify_user_errors_exit_2(committed, tmp_path: Path) -> None:
    data, proofs, root = committed
    cases = [
        (["--data", str(data)], "exactly one of --root"),
        (["--data", str(data), "--root", "abc"], "64 hex digits"),
        (["--data", str(data), "--root", root, "--line", "2"], "needs --proofs"),
        (["--data", str(data), "--root", root, "--proofs", str(proofs), "--line", "9"], "line 9"),
        (["--data", str(tmp_path / "none.jsonl"), "--root", root], "cannot read"),
        (["--data", str(data), "--merkle", str(data)], "expected a merkle.json"),
    ]
    for args, message in cases:
        result = verify(*args)
        assert result.exit_code == 2, args
        assert message in result.output, (args, result.output)


def test_value_without_data_exits_2() -> None:
    result = runner.invoke(app, ["value"])
    assert result.exit_code == 2 and "--data" in result.output


def test_value_runs_and_its_commitment_verifies(tiny_path: Path, tmp_path: Path) -> None:
    data = tmp_path / "rows.jsonl"
    examples = make_task("sentiment").examples(16, seed=2)
    data.write_text(
        "".join(json.dumps({"prompt": e.prompt, "answer": e.answer}) + "\n" for e in examples)
        + "oops\n"
    )
    config = tmp_path / "v.yaml"
    config.write_text("methods: [knn_shapley]\nshapley: {knn_k: 3}\n")
    out = tmp_path / "out"
    args = ["value", "--config", str(config), "--data", str(data), "--out", str(out)]
    result = runner.invoke(app, [*args, "--model", str(tiny_path), "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert "skipped line 17: invalid JSON" in result.output
    assert "13 rows valued (knn_shapley)" in result.output  # 16 - round(0.2 * 16) held out
    check = verify("--data", str(data), "--merkle", str(out / "merkle.json"))
    assert check.exit_code == 0 and "all 17 lines verified" in check.output
