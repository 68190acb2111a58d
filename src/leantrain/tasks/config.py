"""Task settings: which verifiable task, its options, and how its reward parts add up."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from leantrain.settings import Strict


class RewardWeights(BaseModel):
    """Weight of each reward part in the total.

    The defaults make a right answer (or a program that really ran and printed it) what counts,
    with a small bonus for the format alone, which a policy learns first and which keeps a
    learning signal in groups where no answer is right yet.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    format: float = Field(0.1, description="response follows the task's format")
    answer: float = Field(1.0, description="final answer is right")
    tool: float = Field(1.0, description="tool call (code) really ran and gave the right result")


class TaskConfig(Strict):
    name: str = Field(
        "arith",
        description="Task: arith, countdown, code, jsonl, sentiment, tool_arith (multi-turn, "
        "runs Python) or visual (image prompts, needs a vision-language model).",
    )
    options: dict[str, Any] = Field(
        default_factory=dict, description="Task constructor options, e.g. {max_items: 16}."
    )
    reward_weights: RewardWeights = Field(
        default_factory=RewardWeights,
        description="Weight of each reward part (format, answer, tool) in the total reward.",
    )
    eval_size: int = Field(
        200,
        ge=1,
        description="Test problems (new problems of the task, never trained on) for accuracy "
        "before/after (greedy decoding); more give a steadier figure at the cost of longer "
        "evaluations.",
    )
