"""Safety settings: `leantrain unlearn` (`UnlearnConfig`, with each method's tuned defaults),
`leantrain audit` (`AuditConfig`, the attacks' strength) and `leantrain elicit`
(`ElicitConfig`, the sandbagging experiment)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from leantrain.settings import Strict

Method = Literal["ga", "graddiff", "npo", "rmu", "rmu_multilayer"]
METHODS: tuple[str, ...] = ("ga", "graddiff", "npo", "rmu", "rmu_multilayer")


# Per method: the steps, learning rate and retain weight that remove the built-in corpus's forget
# set from the memorised tiny model (direct extraction near the retain-only model's chance level)
# with the most retain utility left, picked from a small grid (steps 10-80, lr 3e-5 to 1e-3,
# retain weight 1-100; docs/benchmarks.md has the figures). One shared setting cannot serve them
# all: at 40 steps x 1e-3, GA, GradDiff and RMU wiped the retain set too. GA has no retain term and
# costs most of the utility whatever its setting; RMU's state-matching term needs a large weight
# against the misdirection term's scale.
TUNED: dict[str, dict[str, float]] = {
    "ga": {"steps": 40, "lr": 1e-4, "retain_weight": 0.0},
    "graddiff": {"steps": 60, "lr": 3e-4, "retain_weight": 4.0},
    "npo": {"steps": 60, "lr": 5e-4, "retain_weight": 4.0},
    "rmu": {"steps": 80, "lr": 1e-3, "retain_weight": 30.0},
    "rmu_multilayer": {"steps": 80, "lr": 1e-3, "retain_weight": 30.0},
}
# The same on SmolLM2-135M-Instruct memorised with `RECIPES["smollm2-135m"]` (safety/memorise.py),
# for the methods its audit runs. Chosen a priori, not tuned (there was no time for a grid on
# the training data in a 45-minute run; nothing was picked on forget_eval): a pretrained 135M
# model's step costs ~150x the tiny one's, so 20 steps of 16, at 1e-4, a fifth of the peak rate
# that memorised the facts (a pretrained model fine-tunes at ~1e-5 to 1e-4; the tiny model's
# 5e-4 and 1e-3 would wreck it); the retain weights are the tiny model's.
# GA (not in the default run; `--methods ga`), the method whose facts relearning brought back
# most on the tiny model: a fifth of NPO's rate, since its loss is unbounded (NPO bounds it).
TUNED_SMOLLM2: dict[str, dict[str, float]] = {
    "ga": {"steps": 20, "lr": 2e-5, "retain_weight": 0.0},
    "npo": {"steps": 20, "lr": 1e-4, "retain_weight": 4.0},
    "rmu_multilayer": {"steps": 20, "lr": 1e-4, "retain_weight": 30.0},
}
TUNED_BY_MODEL: dict[str, dict[str, dict[str, float]]] = {
    "tiny": TUNED,
    "smollm2-135m": TUNED_SMOLLM2,
}
_TUNED_NOTE = " Default: the method's tuned value (`TUNED`)."


class UnlearnConfig(Strict):
    """How to unlearn the forget set. `steps`, `lr` and `retain_weight` default to the values
    tuned for each method on the tiny model and the built-in corpus (`TUNED`)."""

    method: Method = Field("npo", description="ga, graddiff, npo, rmu or rmu_multilayer.")
    steps: int = Field(
        int(TUNED["npo"]["steps"]),
        ge=1,
        description="Optimizer steps; more forgets more and costs more retain utility."
        + _TUNED_NOTE,
    )
    lr: float = Field(TUNED["npo"]["lr"], gt=0.0, description="AdamW learning rate." + _TUNED_NOTE)
    batch_size: int = Field(16, ge=1, description="Forget (and retain) facts per step.")
    retain_weight: float = Field(
        TUNED["npo"]["retain_weight"],
        ge=0.0,
        description="Weight of the retain term (graddiff, npo, rmu variants)." + _TUNED_NOTE,
    )
    npo_beta: float = Field(
        0.1, gt=0.0, description="NPO temperature; small beta behaves like gradient ascent."
    )
    rmu_layer: int = Field(
        2, ge=1, description="Layer (1 = first block's output) whose states `rmu` misdirects."
    )
    rmu_steer: float = Field(
        4.0, gt=0.0, description="RMU target norm, in multiples of the layer's mean state norm."
    )
    seed: int = Field(0, description="Seeds batch order and the RMU direction.")

    @model_validator(mode="before")
    @classmethod
    def _tuned_defaults(cls, data: Any) -> Any:
        """Settings left out take the chosen method's tuned values."""
        if isinstance(data, dict):
            return {**TUNED.get(data.get("method", "npo"), {}), **data}
        return data


class AuditConfig(Strict):
    """Strength of the attacks (defaults calibrated on the memorised tiny model: see fields)."""

    relearn_steps: int = Field(
        40,
        ge=1,
        description="Fine-tuning steps of the relearning attack (full batch each). With the "
        "default lr, 40 relearn the attack people's facts without disturbing the others on the "
        "memorised model (forget_eval extraction stays at 96%).",
    )
    relearn_lr: float = Field(
        1e-4,
        gt=0.0,
        description="Learning rate of the relearning attack; 1e-3 (20 steps) overfits the 24 "
        "attack facts: on a model that knew every forget_eval fact it left 42% of them.",
    )
    shots: int = Field(
        1,
        ge=1,
        description="Known facts before the question (in-context attack). The memorised model "
        "saw one-shot layouts in training; at 2 or more shots it no longer answers at all.",
    )
    seed: int = Field(0, description="Seeds the relearning attack.")


# The relearning attack's strength per base model (AuditConfig's defaults are the tiny model's).
# SmolLM2's: 10 steps (a step costs ~150x the tiny model's) at 5e-5, a tenth of the peak rate that
# memorised the facts. Calibrated as the tiny model's attack was, on the memorised model (the
# attack should not wipe the facts it is meant to reveal): the first, a-priori choice, 10 x 2e-4,
# took its forget_eval extraction from 62% to 33%; 5e-5 leaves 46% (docs/safety.md has both runs).
AUDIT_BY_MODEL: dict[str, dict[str, Any]] = {
    "tiny": {},
    "smollm2-135m": {"relearn_steps": 10, "relearn_lr": 5e-5},
}


class ElicitConfig(Strict):
    """The sandbagging experiment (defaults sized for the tiny model on a CPU)."""

    model: str = Field(
        "tiny",
        description="The model locked: a preset (tiny, smollm2-135m) or a model folder. Prompts "
        "go through its chat template if it has one.",
    )
    min_items: int = Field(3, ge=2, description="Shortest `arith` list.")
    max_items: int = Field(5, ge=2, description="Longest `arith` list (short: cheap RL).")
    weak_slip_rate: float = Field(
        0.75,
        ge=0.0,
        le=1.0,
        description="Share of the weak demonstrator's solutions with one arithmetic slip; higher "
        "makes its demonstrations worse. 0.75 (a quarter right) keeps the demonstrator below "
        "the tiny model's own skill (about 45% on 3-5 numbers).",
    )
    lock_steps: int = Field(300, ge=1, description="SFT steps that password-lock the model.")
    lock_lr: float = Field(1e-3, gt=0.0, description="Learning rate of the locking SFT.")
    batch_size: int = Field(32, ge=1, description="Texts per step of locking and SFT elicitation.")
    n_demos: int = Field(64, ge=1, description="Weak demonstrations SFT elicitation trains on.")
    sft_steps: int = Field(40, ge=1, description="SFT elicitation steps (of `batch_size`).")
    sft_lr: float = Field(5e-4, gt=0.0, description="SFT elicitation learning rate.")
    rl_steps: int = Field(20, ge=1, description="GRPO steps against the weak grader.")
    rl_lr: float = Field(5e-5, gt=0.0, description="GRPO learning rate.")
    prompts_per_step: int = Field(16, ge=1, description="GRPO prompts per step.")
    group_size: int = Field(8, ge=2, description="GRPO samples per prompt.")
    max_new_tokens: int = Field(48, ge=8, description="Response cap (a 5-item sum needs ~40).")
    eval_size: int = Field(
        100, ge=1, description="Test problems (never trained on) for every accuracy."
    )
    seed: int = Field(0, description="Seeds problems, demonstrations and training.")
    device: Literal["auto", "cpu", "cuda"] = Field("cpu", description="Where RL runs.")
