"""A batch without learning signal is recognised, its likely cause named, and a run that stays
there warns once per streak and in its summary."""

from __future__ import annotations

from pathlib import Path

from leantrain.rl.config import RLConfig
from leantrain.rl.grpo import GRPORun, accuracy_part
from leantrain.rl.learning_signal import NO_SIGNAL_STEPS, NoSignalWatch, has_signal, likely_cause
from leantrain.rl.trajectory import Trajectory
from leantrain.settings import load_settings


def _traj(group: int, fmt: float, answer: float, weight_format: float = 0.1) -> Trajectory:
    return Trajectory(
        prompt_ids=[1],
        response_ids=[2],
        logprobs=[-1.0],
        versions=[0],
        loss_mask=[1],
        finish_reason="eos",
        rewards={"format": fmt, "answer": answer},
        reward=weight_format * fmt + answer,
        group_id=group,
        text="seven",
    )


def _solved(t: Trajectory) -> float:
    return accuracy_part(t.rewards)


def test_one_group_with_different_rewards_is_signal() -> None:
    assert has_signal([_traj(0, 1, 1), _traj(0, 1, 1), _traj(1, 1, 0), _traj(1, 1, 1)])
    assert not has_signal([_traj(0, 1, 1), _traj(0, 1, 1), _traj(1, 0, 0), _traj(1, 0, 0)])


def test_the_cause_is_read_from_the_reward_parts() -> None:
    never_formatted = [_traj(0, 0, 0), _traj(0, 0, 0)]
    assert "format reward is 0" in likely_cause(never_formatted, _solved)
    assert "too easy" in likely_cause([_traj(0, 1, 1), _traj(1, 1, 1)], _solved)
    assert "too hard" in likely_cause([_traj(0, 1, 0), _traj(1, 1, 0)], _solved)
    mixed = [_traj(0, 1, 1), _traj(0, 1, 1), _traj(1, 1, 0), _traj(1, 1, 0)]
    assert "equal rewards" in likely_cause(mixed, _solved)


def test_the_watch_warns_once_per_streak() -> None:
    watch = NoSignalWatch(_solved)
    flat = [_traj(0, 0, 0), _traj(0, 0, 0)]
    learning = [_traj(0, 1, 1), _traj(0, 1, 0)]
    said = [watch.observe(step, flat) for step in range(1, NO_SIGNAL_STEPS + 3)]
    assert [s is not None for s in said] == [False] * (NO_SIGNAL_STEPS - 1) + [True, False, False]
    assert f"steps 1-{NO_SIGNAL_STEPS}" in said[NO_SIGNAL_STEPS - 1]
    assert "'seven'" in said[NO_SIGNAL_STEPS - 1]  # a sampled response, to see what went wrong
    assert watch.observe(9, learning) is None and watch.streak == 0
    assert len(watch.warnings) == 1


def test_a_run_that_cannot_learn_says_so_in_its_summary(tiny_path: Path, tmp_path: Path) -> None:
    # No reward part counts: every group's rewards are equal, whatever the model writes.
    zero = {"format": 0.0, "answer": 0.0, "tool": 0.0}
    cfg = load_settings(
        RLConfig,
        None,
        **{
            "model.name": str(tiny_path),
            "out": tmp_path / "run",
            "device": "cpu",
            "steps": NO_SIGNAL_STEPS,
            "task.eval_size": 2,
            "task.reward_weights": zero,
            "sampling.max_new_tokens": 16,
            "grpo.prompts_per_step": 2,
            "grpo.group_size": 2,
        },
    )
    summary = GRPORun(cfg, progress=False).run()
    [warning] = summary["warnings"]
    assert f"steps 1-{NO_SIGNAL_STEPS}" in warning and "loss and gradient is 0" in warning
