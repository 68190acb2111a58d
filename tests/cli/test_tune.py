"""`leantrain tune`: exit code 2 with one clear line for user errors; a real tiny run."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from leantrain.cli import app

runner = CliRunner()
CONFIG = str(Path(__file__).parents[2] / "configs" / "tiny-sft.yaml")


def test_bad_method_exits_2() -> None:
    result = runner.invoke(app, ["tune", "--config", CONFIG, "--method", "qlora"])
    assert result.exit_code == 2 and "method" in result.output


def test_missing_data_file_exits_2(tmp_path: Path) -> None:
    result = runner.invoke(app, ["tune", "--data", str(tmp_path / "nope.jsonl")])
    assert result.exit_code == 2 and "not found" in result.output


def test_tune_runs(tiny_path: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    args = ["tune", "--config", CONFIG, "--steps", "1", "--out", str(out), "--device", "cpu"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "test accuracy after" in result.output
    assert json.loads((out / "summary.json").read_text())["method"] == "lars"
