"""Speculation settings: when the rollouts' long tail speculates, with which drafters and draft
lengths, and whether the EAGLE drafter trains online."""

from __future__ import annotations

import typing
from typing import Literal

from pydantic import Field, model_validator

from leantrain.settings import Strict

DrafterType = Literal["suffix", "eagle"]


class SpeculativeConfig(Strict):
    """Speculative decoding in the rollouts' long tail (generation/speculative.py, TLT)."""

    enabled: bool = Field(
        False, description="Speculate in the long tail. Lossless, so it only changes speed."
    )
    threshold: int = Field(
        8,
        ge=1,
        description="Speculate only while at most this many sequences are live. Above it a "
        "batched step already keeps the hardware busy and verifying drafts costs real compute "
        "(TLT uses 32 on GPUs; on a CPU the break-even batch is smaller).",
    )
    draft_lengths: list[int] = Field(
        [2, 4, 6],
        min_length=1,
        description="Draft lengths the bandit chooses from (0 = an arm that does not "
        "speculate). Longer drafts win when acceptance is high and lose when it is not.",
    )
    drafters: list[str] = Field(
        ["suffix", "eagle"],
        min_length=1,
        description="Drafter types the bandit chooses from: `suffix` (model-free, from earlier "
        "responses to the same prompt and recent steps; almost free per token) and `eagle` "
        "(one-layer drafter over the target's hidden states, trained online).",
    )
    train_drafter: bool = Field(
        False,
        description="Train the EAGLE drafter online on the hidden states each rollout captures, "
        "in a background thread, so it keeps up with the policy as RL changes it.",
    )
    epsilon: float = Field(
        0.1, ge=0.0, le=1.0, description="Bandit exploration rate (TLT's default 0.1)."
    )

    @model_validator(mode="after")
    def _check_arms(self) -> SpeculativeConfig:
        if any(k < 0 for k in self.draft_lengths):
            raise ValueError(f"draft_lengths must be >= 0, got {self.draft_lengths}")
        known = typing.get_args(DrafterType)
        unknown = set(self.drafters) - set(known)
        if unknown:
            raise ValueError(f"unknown drafters {sorted(unknown)}; known: {list(known)}")
        return self
