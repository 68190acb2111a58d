"""The command line: exit code 2 with one clear line for user errors; a real tiny run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from leantrain.cli import app
from leantrain.cli.rl import DEMO_SETTINGS, demo_config
from leantrain.errors import LeantrainError
from leantrain.models import export_model, load_model
from leantrain.rl.config import RLConfig
from leantrain.rl.grpo import GRPORun
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


def test_nproc_per_node_2_equals_one_process(tiny_path: Path, tmp_path: Path) -> None:
    """`leantrain rl --nproc-per-node 2` re-launches itself under torchrun (`python -m
    torch.distributed.run ... -m leantrain rl`): 2 gloo ranks train what one process trains."""
    settings = {
        "steps": 2,
        "device": "cpu",
        "threads": 1,
        "task.eval_size": 4,
        "sampling.max_new_tokens": 24,
        "grpo.prompts_per_step": 2,
        "grpo.group_size": 4,
        "grpo.lr": 1e-3,
    }
    overrides = [a for k, v in settings.items() for a in ("-o", f"{k}={v}")]
    two = tmp_path / "two"
    command = [sys.executable, "-m", "leantrain", "rl", "--nproc-per-node", "2", "--out", str(two)]
    result = subprocess.run(
        [*command, *overrides], capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "test accuracy after" in result.stdout  # rank 0's table, printed once
    assert result.stdout.count("leantrain rl") == 1
    one = GRPORun(load_settings(RLConfig, None, out=tmp_path / "one", **settings), progress=False)
    one.run()
    # The 2 ranks' checkpoint is sharded (torch.distributed.checkpoint); evaluation loads it
    # like any model folder, tokenizer included.
    checkpoint = two / "checkpoints" / "step-000002"
    assert (checkpoint / ".metadata").is_file() and not (checkpoint / "model.safetensors").exists()
    model, tokenizer = load_model(checkpoint, dtype="float32")
    assert tokenizer.vocab_size == one.tokenizer.vocab_size
    trained = one.learner.model.state_dict()
    for name, value in model.state_dict().items():
        assert (value - trained[name]).abs().max() <= 1e-6, name
    exported = load_file(export_model(checkpoint, tmp_path / "hf") / "model.safetensors")
    for name, value in exported.items():  # a plain HF folder, for vLLM; tied head saved once
        assert torch.equal(value, model.state_dict()[name]), name
    records = [json.loads(line) for line in (two / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert [r["reward"] for r in records] == [r["reward"] for r in one.metrics.read()]


def test_a_rank_count_that_does_not_divide_the_batch_is_refused(
    small_rl_config: RLConfig, monkeypatch
) -> None:
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1"}
    for key, value in {**env, "MASTER_PORT": "1"}.items():  # refused before any connection
        monkeypatch.setenv(key, value)
    with pytest.raises(LeantrainError, match=r"3 ranks do not divide the batch of grpo\.prompts"):
        GRPORun(small_rl_config, progress=False)
