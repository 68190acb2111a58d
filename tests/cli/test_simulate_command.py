"""`leantrain simulate`: calibrate on a run folder, plan a cluster, refuse bad input with exit 2."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from leantrain.cli import app

runner = CliRunner()


def _fake_run(folder: Path) -> Path:
    folder.mkdir()
    with (folder / "metrics.jsonl").open("w") as f:
        for step, lengths in enumerate([[10, 40, 12, 9], [8, 8, 30, 11], [15, 9, 60, 7]]):
            gen = 0.005 * max(lengths) + 0.0002 * sum(lengths)
            record = {
                "step": step + 1,
                "generate_s": gen,
                "train_s": 0.2,
                "response_lengths": lengths,
            }
            f.write(json.dumps(record) + "\n")
    return folder


def test_simulate_a_run(tmp_path: Path) -> None:
    result = runner.invoke(app, ["simulate", "--run", str(_fake_run(tmp_path / "run"))])
    assert result.exit_code == 0, result.output
    for setup in ("sync", "async k=1", "async k=2", "async k=1 + SD"):
        assert setup in result.output
    assert "decode iteration 5.00 ms + 200.0 us" in result.output  # the fitted costs


def test_plan_writes_a_plot(tmp_path: Path) -> None:
    plot = tmp_path / "plan.png"
    args = ["simulate", "--plan", "8,16", "--sequences", "256", "--median", "100"]
    args += ["--p90", "400", "--max-tokens", "2000", "--plot", str(plot)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert plot.stat().st_size > 1000
    assert "async k=2" in result.output


def test_bad_input_exits_2(tmp_path: Path) -> None:
    for args in (
        ["simulate"],
        ["simulate", "--plan", "lots"],
        ["simulate", "--run", str(tmp_path)],
        ["simulate", "--plan", "64", "--median", "900", "--p90", "100"],
    ):
        result = runner.invoke(app, args)
        assert result.exit_code == 2, (args, result.output)
        assert "error" in result.output


def test_learner_prints_the_step_and_the_sync_rl_total():
    args = ["simulate", "--learner", "--model", "qwen2.5-0.5b", "--gpus", "4", "--tokens", "1e6"]
    result = runner.invoke(app, [*args, "--seq-len", "1000", "--rollout-s", "10"])
    assert result.exit_code == 0, result.output
    for row in ("compute", "FSDP traffic", "Ulysses all-to-all", "learner step", "weight sync"):
        assert row in result.output
    assert "sync RL step" in result.output and "memory per GPU" in result.output


def test_plan_with_the_learner() -> None:
    args = ["simulate", "--plan", "8", "--sequences", "256", "--median", "100", "--p90", "400"]
    args += ["--max-tokens", "2000", "--learner", "--model", "qwen2.5-0.5b", "--seq-len", "2000"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "qwen2.5-0.5b on h100" in result.output


def test_learner_bad_input_exits_2_naming_the_setting(tmp_path: Path) -> None:
    base = ["simulate", "--learner", "--tokens", "1e6"]
    for args, named in (
        (["simulate", "--learner"], "--tokens"),
        ([*base, "--sequence-parallel", "3"], "sequence_parallel"),
        ([*base, "--gpu", "v100"], "unknown gpu"),
        ([*base, "--mfu", "0"], "mfu"),
        ([*base, "--model", "llama3-70b", "--gpus", "2"], "does not fit"),
        ([*base, "--run", str(tmp_path)], "not with --run"),
        ([*base, "--rollout-s", "-1"], "--rollout-s"),
    ):
        result = runner.invoke(app, args)
        assert result.exit_code == 2, (args, result.output)
        assert named in result.output, (args, result.output)
