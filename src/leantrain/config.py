"""Run configuration: pydantic models shared by the CLI and the Python API. YAML files under
`configs/` load into `RLConfig`; every field carries help text, and a bad value raises a
`LeantrainError` that names the field and what was expected."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from leantrain.errors import LeantrainError
from leantrain.tasks.rewards import RewardWeights


class Strict(BaseModel):
    """Base of every config model: a misspelt key is an error, not a silently ignored setting."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


SettingsT = TypeVar("SettingsT", bound=BaseModel)


class ModelConfig(Strict):
    name: str = Field("tiny", description="Preset (`tiny`, `smollm2-135m`) or a local HF folder.")
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description="Compute dtype (weights stay float32): `auto` is bfloat16 autocast on CUDA "
        "and float32 on CPU.",
    )


class TaskConfig(Strict):
    name: str = Field("arith", description="Task: arith, countdown, code or jsonl.")
    options: dict[str, Any] = Field(
        default_factory=dict, description="Task constructor options, e.g. {max_items: 16}."
    )
    reward_weights: RewardWeights = Field(
        default_factory=RewardWeights,
        description="Weight of each reward part (format, answer, tool) in the total reward.",
    )
    eval_size: int = Field(
        200, ge=1, description="Held-out problems for accuracy before/after (greedy decoding)."
    )


class SamplingConfig(Strict):
    max_new_tokens: int = Field(
        320, ge=1, description="Response cap; longer responses finish with reason `length`."
    )
    temperature: float = Field(
        0.7, ge=0.0, description="Sampling temperature; lower is safer, higher explores more."
    )
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    top_k: int = Field(0, ge=0, description="Keep the k most likely tokens; 0 keeps all.")


class GRPOConfig(Strict):
    prompts_per_step: int = Field(16, ge=1, description="Distinct prompts per optimizer step.")
    group_size: int = Field(
        8, ge=2, description="Responses per prompt; advantages are relative within a group."
    )
    lr: float = Field(
        5e-5,
        gt=0.0,
        description="AdamW learning rate. On the tiny model 5e-5 learns; 3e-4 collapses it "
        "within 20 steps (Adam moves every weight by about lr per step).",
    )
    warmup_steps: int = Field(
        10,
        ge=0,
        description="Linear learning-rate warm-up. Adam's first updates move every weight by "
        "about lr whatever its gradient; warming up keeps those noisy steps small.",
    )
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay.")
    loss_type: Literal["grpo", "dr_grpo", "dapo", "bnpo"] = Field(
        "dapo",
        description="Token normalization. grpo: per-sequence mean (length-biased); dr_grpo: "
        "divide by batch x max_new_tokens; dapo: divide by active tokens of the step (default, "
        "no length bias, exact under micro-batching).",
    )
    scale_rewards: Literal["group", "batch", "none"] = Field(
        "batch",
        description="Divide centred rewards by the std of the batch (default), of each group, or "
        "not at all. Group std blows tiny differences (format alone, in a group where no answer "
        "is right) up to unit-size advantages; on the tiny model that stalled learning.",
    )
    epsilon: float = Field(
        0.2, gt=0.0, description="PPO clip range below 1 (and above, by default)."
    )
    epsilon_high: float | None = Field(
        None, gt=0.0, description="Upper clip range; DAPO suggests 0.28. Default: epsilon."
    )
    beta: float = Field(
        0.0, ge=0.0, description="Weight of the k3 KL to the frozen initial policy; 0 skips it."
    )
    num_iterations: int = Field(
        1, ge=1, description="Optimizer passes over each batch (ratios use behaviour logprobs)."
    )
    mask_truncated: bool = Field(
        False, description="Exclude responses cut off at max_new_tokens from the loss."
    )
    max_grad_norm: float = Field(1.0, gt=0.0, description="Gradient-norm clipping threshold.")
    micro_batch_tokens: int = Field(
        512,
        ge=16,
        description="Token budget of one packed forward. On CPU attention over a packed row is "
        "dense (quadratic in its length), so small is fast; with flash-attention on GPUs larger "
        "rows are cheaper.",
    )


class RLConfig(Strict):
    """A GRPO run: `leantrain rl --config FILE` loads one of these."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    task: TaskConfig = Field(default_factory=TaskConfig)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    grpo: GRPOConfig = Field(default_factory=GRPOConfig)
    steps: int = Field(120, ge=0, description="Optimizer steps (one rollout batch each).")
    seed: int = Field(0, description="Seeds prompts, sampling and initialization.")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="auto picks CUDA if present."
    )
    out: Path = Field(Path("runs/rl"), description="Run folder: metrics, plots, checkpoints.")
    max_batch_size: int = Field(
        128, ge=1, description="Live sequences in the rollout engine at once."
    )
    checkpoint_every: int = Field(10, ge=1, description="Steps between checkpoints.")
    keep_checkpoints: int = Field(2, ge=1, description="Checkpoints kept on disk (newest).")
    log_completions: int = Field(
        2, ge=0, description="Sampled completions appended to completions.jsonl each step."
    )


def format_validation_error(err: ValidationError, source: str) -> str:
    """One line per problem: `source: field.path: message (got value)`."""
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(top level)"
        got = f" (got {e['input']!r})" if "input" in e and not isinstance(e["input"], dict) else ""
        lines.append(f"{source}: {loc}: {e['msg']}{got}")
    return "\n".join(lines)


def load_config(path: str | Path | None, **overrides: Any) -> RLConfig:
    """Load a GRPO run config (or the defaults when `path` is None) and apply dotted overrides,
    e.g. `load_config("configs/tiny-arith.yaml", steps=4, **{"model.name": "tiny"})`."""
    return load_settings(RLConfig, path, **overrides)


def load_settings(cls: type[SettingsT], path: str | Path | None, **overrides: Any) -> SettingsT:
    """Load a YAML file into the pydantic model `cls` (its defaults when `path` is None), after
    applying dotted overrides whose value is not None. Every area's config loads through here, so
    a bad file or field always fails the same way: a LeantrainError naming the field."""
    data: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        source = str(path)
        p = Path(path)
        if not p.is_file():
            raise LeantrainError(f"config file not found: {p}")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise LeantrainError(f"{p}: not valid YAML: {e}") from None
        if not isinstance(data, dict):
            raise LeantrainError(f"{p}: expected a mapping of settings, got {type(data).__name__}")
    for dotted, value in overrides.items():
        if value is None:
            continue
        node = data
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        raise LeantrainError(format_validation_error(e, source)) from None
