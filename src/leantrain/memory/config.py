"""`leantrain tune` settings: YAML files such as `configs/tiny-sft.yaml` load into `TuneConfig`
(the method, its LoRA and LARS sizes, the optimizer and the run)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from leantrain.distributed.config import DistributedConfig
from leantrain.models.config import LLAMA_PROJECTIONS, LoraSettings, ModelConfig
from leantrain.settings import Strict
from leantrain.telemetry.config import TelemetryConfig

Method = Literal["full", "lora", "lars", "lora+lars"]


class LarsSettings(Strict):
    rank: int = Field(
        8,
        ge=1,
        description="Rank of the saved activation subspace. Memory per token per layer is rank "
        "numbers instead of the layer's input width; the gradient is exact at rank >= that width.",
    )


class TuneConfig(Strict):
    """An SFT run: `leantrain tune --config FILE` loads one of these."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    task: str = Field(
        "sentiment", description="Built-in task whose worked solutions are the training data."
    )
    task_options: dict[str, Any] = Field(
        default_factory=dict, description="Task constructor options, e.g. {max_words: 3}."
    )
    data: Path | None = Field(
        None,
        description="JSONL of {prompt, completion} rows to train on instead of the task; the "
        "last `eval_size` rows are held out and scored by exact match.",
    )
    method: Method = Field(
        "lars",
        description="full: every weight (most memory); lora: peft adapters (few parameters, but "
        "activations still grow with length); lars: full weights of `targets` with activations "
        "saved at low rank (and the lean kernels, see lean_kernels); lora+lars: LoRA with "
        "LARS-compressed adapter inputs.",
    )
    targets: list[str] = Field(
        default_factory=lambda: list(LLAMA_PROJECTIONS),
        description="Linear layers LoRA and LARS adapt (module name endings).",
    )
    lora: LoraSettings = Field(default_factory=LoraSettings)
    lars: LarsSettings = Field(default_factory=LarsSettings)
    lean_kernels: bool | None = Field(
        None,
        description="Swap the gated MLP's SiLU product and the RMSNorms for kernels that keep "
        "fewer tensors for backward (exact gradients; `leantrain.memory.kernels`). null: on "
        "for lars and lora+lars, off for full and lora, which stay the stock baselines.",
    )
    gradient_checkpointing: bool = Field(
        False, description="Recompute each layer in backward: less memory, about 30% more time."
    )
    steps: int = Field(100, ge=0, description="Optimizer steps.")
    batch_size: int = Field(32, ge=1, description="Examples per optimizer step.")
    chunks: int = Field(1, ge=1, description="Forward passes per step (memory vs speed).")
    lr: float = Field(
        2e-3,
        gt=0,
        description="Peak AdamW learning rate (linear warm-up, cosine to 10%). LoRA and small "
        "models take larger rates than full fine-tuning of big ones.",
    )
    warmup_steps: int = Field(5, ge=0, description="Linear learning-rate warm-up.")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient-norm clipping threshold.")
    eval_size: int = Field(
        200, ge=1, description="Test prompts (never trained on) for accuracy before/after."
    )
    max_new_tokens: int = Field(16, ge=1, description="Greedy response cap when evaluating.")
    seed: int = Field(0, description="Seeds data, initialization and adapters.")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto picks CUDA if any.")
    out: Path = Field(Path("runs/tune"), description="Run folder: metrics, plot, summary.")
    log_completions: int = Field(4, ge=0, description="Test completions kept after training.")
    telemetry: TelemetryConfig = Field(
        default_factory=TelemetryConfig,
        description="Trackers to report to (TensorBoard, W&B, MLflow, trackio).",
    )
    distributed: DistributedConfig = Field(
        default_factory=DistributedConfig,
        description="How ranks wait for each other under `--nproc-per-node` or "
        "`--sequence-parallel` (the number of ranks is torchrun's).",
    )
