"""`leantrain zo` settings: YAML files such as `configs/tiny-zo.yaml` load into `ZOConfig`; every
field has help text and a bad value raises a LeantrainError naming it."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from leantrain.models.config import ModelConfig
from leantrain.settings import Strict
from leantrain.telemetry.config import TelemetryConfig


class ZOTaskConfig(Strict):
    name: str = Field(
        "sentiment",
        description="A classification task in prompt form with verbalised labels (`sentiment`); "
        "ignored when `data` is set.",
    )
    options: dict[str, Any] = Field(default_factory=dict, description="Task constructor options.")
    train_size: int = Field(
        512, ge=1, description="Training examples drawn once; each step samples a batch of them."
    )
    eval_size: int = Field(
        200, ge=1, description="Test examples (never trained on) for accuracy before/after."
    )


class ZOSettings(Strict):
    estimator: Literal["spsa", "one_sided"] = Field(
        "spsa",
        description="spsa: two-sided, +eps z and -eps z per direction (MeZO; n-SPSA with "
        "directions > 1). one_sided: the unperturbed loss plus `directions` one-sided states, step "
        "normalised by the spread of their losses (FZOO); needs directions >= 2.",
    )
    directions: int = Field(
        1,
        ge=1,
        description="Directions per step; more lowers the estimate's variance, each "
        "costs one or two more scored states.",
    )
    eps: float = Field(
        1e-3, gt=0.0, description="Perturbation scale. MeZO: 1e-3 full, 1e-2 with LoRA."
    )
    lr: float = Field(
        1e-4,
        gt=0.0,
        description="Step size of theta <- theta - lr * g * z. ZO steps are noisy: "
        "MeZO uses 1e-6..1e-7 on full OPT models and 5e-5 with LoRA.",
    )
    batch_size: int = Field(16, ge=1, description="Training examples scored per step (MeZO: 16).")
    target: Literal["lora", "all"] = Field(
        "lora",
        description="lora: perturb only peft LoRA factors over the frozen base (small states, "
        "scored together in one forward); all: every parameter, scored one state at a time.",
    )
    lora_r: int = Field(8, ge=1, description="LoRA rank (MeZO's LoRA mode: 8).")
    lora_alpha: int = Field(16, ge=1, description="LoRA scaling numerator (scaling alpha / r).")
    lora_targets: list[str] = Field(
        default_factory=lambda: ["q_proj", "v_proj"],
        description="Module names that get LoRA factors.",
    )
    sparse_fraction: float | None = Field(
        None,
        gt=0.0,
        le=1.0,
        description="Sparse MeZO: perturb and update only this fraction of each tensor's "
        "entries, the smallest in magnitude; null perturbs all.",
    )
    engine: Literal["inference", "reference"] = Field(
        "inference",
        description="inference: our engine (inference_mode, fused moves, batched scoring). "
        "reference: MeZO's reference loop, for comparison (spsa only, no sparse).",
    )
    forward_tokens: int = Field(
        512,
        ge=16,
        description="Padded tokens per scoring forward through the model's own forward (models "
        "other than Llama). Small is fast on a CPU (stays in cache); raise it on an accelerator.",
    )
    tree_nodes: int = Field(
        2048,
        ge=16,
        description="Prefix-tree nodes per packed scoring forward (Llama models: each distinct "
        "prefix of the batch computed once), all perturbed states together. Larger shares more "
        "prefixes; it bounds activation memory.",
    )

    backend: Literal["native", "vllm"] = Field(
        "native",
        description="Where the perturbed states are scored. native: our engine's own forward "
        "(packed prefix trees, stacked adapters). vllm: an in-process vLLM engine (`make vllm`; "
        "the paper's setting): LoRA states as S adapters batched in one call, all-parameter "
        "states published whole (one weight transfer per state, slow on a big model). Only "
        "scoring moves: seeds, estimate and update stay ours, so the trajectory is the same.",
    )
    vllm_kv_cache_gib: float = Field(
        1.0,
        gt=0.0,
        description="backend vllm: memory for its KV cache, in GiB; must hold one sequence of "
        "vllm_max_model_len tokens.",
    )
    vllm_max_model_len: int | None = Field(
        None,
        ge=16,
        description="backend vllm: longest row it accepts (None: the model's context length, "
        "which may need a large KV cache).",
    )

    @model_validator(mode="after")
    def _reference_runs_mezo_only(self) -> ZOSettings:
        if self.backend == "vllm" and self.engine != "inference":
            raise ValueError(
                "zo.backend: vllm scores the states of zo.engine: inference; the reference loop "
                "runs on its own forward (zo.backend: native)"
            )
        if self.engine == "reference" and (
            self.estimator != "spsa" or self.sparse_fraction is not None
        ):
            raise ValueError("engine 'reference' runs MeZO only: estimator spsa, no sparse")
        if self.estimator == "one_sided" and self.directions < 2:
            raise ValueError("estimator one_sided needs directions >= 2")
        return self


class ZOConfig(Strict):
    """A ZO fine-tuning run: `leantrain zo --config FILE` loads one of these."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    task: ZOTaskConfig = Field(default_factory=ZOTaskConfig)
    data: Path | None = Field(
        None,
        description="Your own JSONL instead of the task: prompt/completion pairs (loss on the "
        "completion) or {text} rows (language-modelling loss).",
    )
    max_tokens: int = Field(
        256, ge=2, description="Longest training row from `data`; longer texts are windowed."
    )
    zo: ZOSettings = Field(default_factory=ZOSettings)
    steps: int = Field(200, ge=0, description="ZO steps.")
    seed: int = Field(0, description="Seeds data, LoRA initialisation and direction seeds.")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="auto picks CUDA if present."
    )
    out: Path = Field(Path("runs/zo"), description="Run folder: metrics, plot, summary, model.")
    telemetry: TelemetryConfig = Field(
        default_factory=TelemetryConfig,
        description="Trackers to report to (TensorBoard, W&B, MLflow, trackio).",
    )
    save: Literal["merged", "adapter", "none"] = Field(
        "merged",
        description="The result in out/model: merged (an ordinary HF model folder; LoRA folded "
        "in), adapter (peft adapter folder; `all` targets save the full model), or none.",
    )
