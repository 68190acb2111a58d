"""The command line: exit code 2 with one clear line for user errors; a real tiny run."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from leantrain.cli import app
from leantrain.cli.rl import DEMO_SETTINGS, demo_config
from leantrain.rl.config import RLConfig
from leantrain.settings import load_settings

runner = CliRunner()


def test_bad_config_field_exits_2(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("grpo:\n  lr: -1\n")
    result = runner.invoke(app, ["rl", "--config", str(bad)])
    assert result.exit_code == 2
    assert "grpo.lr" in result.output


def test_bad_overrides_exit_2_naming_the_key() -> None:
    result = runner.invoke(app, ["rl", "-o", "grpo.lrr=1e-4"])
    assert result.exit_code == 2
    assert "grpo.lrr: unknown field; valid: prompts_per_step" in result.output
    result = runner.invoke(app, ["rl", "--override", "orchestrator.mode=fast"])
    assert result.exit_code == 2 and "orchestrator.mode: Input should be" in result.output
    result = runner.invoke(app, ["rl", "-o", "steps"])
    assert result.exit_code == 2 and "expected key.path=value" in result.output


def test_unknown_preset_exits_2(tmp_path: Path) -> None:
    result = runner.invoke(app, ["rl", "--model", "gpt-17", "--out", str(tmp_path / "r")])
    assert result.exit_code == 2
    assert "neither a preset" in result.output


def test_missing_config_exits_2(tmp_path: Path) -> None:
    result = runner.invoke(app, ["rl", "--config", str(tmp_path / "nope.yaml")])
    assert result.exit_code == 2 and "not found" in result.output


def test_rl_runs_and_resumes(tiny_path: Path, tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        "task: {eval_size: 4}\nsampling: {max_new_tokens: 32}\n"
        "grpo: {prompts_per_step: 2, group_size: 2}\ncheckpoint_every: 1\n"
    )
    out = tmp_path / "run"
    args = ["rl", "--config", str(cfg), "--out", str(out), "--device", "cpu"]
    first = runner.invoke(app, [*args, "--steps", "1"])
    assert first.exit_code == 0, first.output
    # New problems of the training task are its test set ("held-out" is for held-out domains).
    assert "test accuracy before" in first.output and "held-out" not in first.output
    assert "4 new problems of the task, greedy" in first.output
    again = runner.invoke(app, [*args, "--steps", "2"])
    assert again.exit_code == 2 and "--resume" in again.output
    resumed = runner.invoke(app, [*args, "--steps", "2", "--resume"])
    assert resumed.exit_code == 0, resumed.output
    assert json.loads((out / "summary.json").read_text())["steps"] == 2


def test_demo_runs_its_settings_and_a_given_steps_wins(tmp_path: Path) -> None:
    cfg = demo_config(None, tmp_path / "demo", None)
    assert cfg.steps == 150 and cfg.grpo.lr_schedule == "cosine" and cfg.model.name == "tiny"
    assert cfg.threads == 2  # the README's figures on any machine's core count
    assert demo_config(3, tmp_path / "demo", "cpu").steps == 3
    assert demo_config(None, tmp_path / "demo", None, threads=1).threads == 1


def test_demo_config_matches_the_demo() -> None:
    # `leantrain demo` runs the defaults plus DEMO_SETTINGS; configs/tiny-arith.yaml documents
    # the same run.
    shipped = load_settings(RLConfig, Path(__file__).parents[2] / "configs" / "tiny-arith.yaml")
    demo = load_settings(RLConfig, None, **DEMO_SETTINGS)
    assert shipped.model_dump(exclude={"out"}) == demo.model_dump(exclude={"out"})


def test_a_jsonl_task_s_accuracy_is_on_its_training_rows(tiny_path: Path, tmp_path: Path) -> None:
    data = tmp_path / "qa.jsonl"
    data.write_text(
        '{"prompt": "sum 2 3\\n", "answer": "5"}\n{"prompt": "sum 7 1\\n", "answer": "8"}\n'
    )
    args = ["rl", "--steps", "1", "--out", str(tmp_path / "run"), "-o", "task.name=jsonl"]
    args += ["-o", f"task.options.path={data}", "-o", "task.eval_size=2"]
    args += ["-o", "grpo.prompts_per_step=2", "-o", "grpo.group_size=2"]
    result = runner.invoke(app, [*args, "-o", "sampling.max_new_tokens=16"])
    assert result.exit_code == 0, result.output
    # Its test draws come from the file's rows, so the table does not call them a test set.
    assert "training-row accuracy before" in result.output and "test accuracy" not in result.output
    assert "2 rows of the data file, greedy" in result.output
