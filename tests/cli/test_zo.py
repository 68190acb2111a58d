"""`leantrain zo`: the shipped config, own data in, an HF folder out, clear errors."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from leantrain.cli import app
from leantrain.models import load_model
from leantrain.settings import load_settings
from leantrain.zo.config import ZOConfig

runner = CliRunner()
CONFIG = Path(__file__).parents[2] / "configs" / "tiny-zo.yaml"


def test_shipped_config_loads() -> None:
    cfg = load_settings(ZOConfig, CONFIG)
    assert cfg.model.name == "tiny" and cfg.task.name == "sentiment" and cfg.zo.target == "lora"


def test_own_data_trains_and_saves_a_loadable_model(tiny_path: Path, tmp_path: Path) -> None:
    data = tmp_path / "notes.jsonl"
    data.write_text(
        '{"prompt": "Where is the spare key?\\n", "completion": "under the blue pot"}\n'
        '{"text": "The boiler is serviced every March by the same engineer."}\n'
    )
    out = tmp_path / "run"
    result = runner.invoke(
        app,
        [
            "zo",
            "--config",
            str(CONFIG),
            "--data",
            str(data),
            "--steps",
            "2",
            "--out",
            str(out),
            "--device",
            "cpu",
        ],
    )
    assert result.exit_code == 0, result.output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2 and "loss_after" in summary and "accuracy_after" not in summary
    # Two rows spare none for a test set, and the table says the loss is the training rows'.
    assert summary["eval_on_training_rows"] and "training loss after" in result.output
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2
    assert (out / "metrics.png").is_file()
    model, _ = load_model(out / "model")  # merged LoRA: an ordinary HF folder
    assert not any("lora" in name for name, _ in model.named_parameters())


def test_user_errors_exit_2(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("zo:\n  engine: reference\n  estimator: one_sided\n  directions: 2\n")
    result = runner.invoke(app, ["zo", "--config", str(bad)])
    assert result.exit_code == 2 and "reference" in result.output
    result = runner.invoke(app, ["zo", "--data", str(tmp_path / "none.jsonl")])
    assert result.exit_code == 2 and "data file not found" in result.output
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "a"}\n')
    result = runner.invoke(app, ["zo", "--data", str(rows), "--out", str(tmp_path / "r")])
    assert result.exit_code == 2 and "line 1" in result.output
