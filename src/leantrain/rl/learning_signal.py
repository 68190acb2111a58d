"""Whether a GRPO batch can teach anything, and why not when it cannot.

GRPO learns only from groups whose responses got different rewards: a group of equal rewards has
advantage 0 for every response, so when every group of a step is like that the loss and its
gradient are exactly 0. A run that stays there (a prompt that never asks for the answer format
the verifier parses, a task far too easy or too hard for the model) trains for nothing in
silence; `NoSignalWatch` says so after a few such steps, naming the likely cause.

Knows nothing about models or optimizers: scored trajectories in, a message out.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from leantrain.rl.trajectory import Trajectory

# Steps in a row without any learning signal before the run warns.
NO_SIGNAL_STEPS = 3


def has_signal(trajectories: Sequence[Trajectory]) -> bool:
    """Whether some group's rewards differ (so some advantage is not 0)."""
    by_group: dict[int, list[float]] = {}
    for t in trajectories:
        by_group.setdefault(t.group_id, []).append(t.reward)
    return any(max(r) - min(r) > 1e-9 for r in by_group.values())


def likely_cause(trajectories: Sequence[Trajectory], solved: Callable[[Trajectory], float]) -> str:
    """The likeliest reason a batch without signal has none, from its reward parts."""
    if all(t.rewards.get("format", 1.0) == 0.0 for t in trajectories):
        return (
            "the format reward is 0 for every response: none matched the answer format the "
            "verifier parses (does the prompt ask for it?)"
        )
    if all(solved(t) >= 1.0 for t in trajectories):
        return "every response is correct: the task is too easy for this model"
    if all(solved(t) == 0.0 for t in trajectories):
        return "every response is wrong: the task is too hard, or its answers never parse"
    return "every group's responses got equal rewards (check the reward weights)"


class NoSignalWatch:
    """Counts steps in a row without learning signal; at `NO_SIGNAL_STEPS` it returns one warning
    (with the cause and a sampled response) and keeps it in `warnings` for the run summary.

    Args:
        solved: what counts as solved for a trajectory (the recipe's `accuracy_part`).
    """

    def __init__(self, solved: Callable[[Trajectory], float]) -> None:
        self.solved = solved
        self.streak = 0
        self.warnings: list[str] = []

    def observe(self, step: int, trajectories: Sequence[Trajectory]) -> str | None:
        """Step `step`'s batch; returns a warning the step the streak reaches its limit."""
        if has_signal(trajectories):
            self.streak = 0
            return None
        self.streak += 1
        if self.streak != NO_SIGNAL_STEPS:
            return None
        sample = trajectories[0]
        message = (
            f"no learning signal in steps {step - NO_SIGNAL_STEPS + 1}-{step}: "
            f"{likely_cause(trajectories, self.solved)}. Every advantage, loss and gradient is "
            f"0, so the policy does not change. A sampled response: {sample.text[:200]!r} "
            f"(rewards {sample.rewards})"
        )
        self.warnings.append(message)
        return message
