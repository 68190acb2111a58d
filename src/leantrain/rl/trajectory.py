"""The contract between rollout and learner: one sampled response and everything the trainer
needs to learn from it. Token ids are kept exactly as sampled and are never re-tokenized."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from leantrain.generation import FinishReason
from leantrain.telemetry.events import SeqTimeline

# A multi-turn episode (rl/episodes.py) can also end on its turn limit or its token budget.
EpisodeEndReason = Literal["max_turns", "budget"]


@dataclass
class Trajectory:
    """One response to one prompt.

    Attributes:
        prompt_ids: prompt token ids, (P,).
        response_ids: response token ids exactly as sampled, (R,).
        logprobs: behaviour log-probabilities of each response token, (R,).
        versions: policy version that sampled each response token, (R,).
        loss_mask: 1 where the token is trained on, 0 for tool/env tokens, (R,).
        finish_reason: why sampling stopped (episodes: also "max_turns" or "budget").
        rewards: named reward parts, e.g. {"format": 1.0, "answer": 0.0}.
        reward: the weighted total used for advantages.
        group_id: trajectories with the same group id answer the same prompt.
        text: decoded response, for logging and scoring only.
        error: a reward function's exception message, if scoring failed.
        pixel_values: (n_images, C, H, W) the prompt's images for a vision-language model, in
            the order their image tokens appear in `prompt_ids`; None for a text prompt.
        timeline: when the sequence went through the backend (telemetry/events.py), for the
            run's events.jsonl; None where not recorded (an episode's forked rows after the
            first, which share the first row's).
    """

    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    loss_mask: list[int]
    finish_reason: FinishReason | EpisodeEndReason
    rewards: dict[str, float] = field(default_factory=dict)
    reward: float = 0.0
    group_id: int = 0
    text: str = ""
    error: str | None = None
    pixel_values: torch.Tensor | None = None
    timeline: SeqTimeline | None = None

    def __post_init__(self) -> None:
        n = len(self.response_ids)
        for name in ("logprobs", "versions", "loss_mask"):
            if len(getattr(self, name)) != n:
                raise ValueError(
                    f"Trajectory.{name} has {len(getattr(self, name))} entries, "
                    f"expected one per response token ({n})"
                )

    @property
    def policy_version(self) -> int:
        """The version that started this trajectory (its first token's)."""
        return self.versions[0] if self.versions else -1
