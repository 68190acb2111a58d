"""`leantrain value` settings: YAML files such as `configs/value.yaml` load into `ValueConfig`
(the rows, the model whose features and gradients value them, each method's knobs, pricing)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from leantrain.models.config import ModelConfig
from leantrain.settings import Strict

Method = Literal["knn_shapley", "tmc_shapley", "beta_shapley", "loo", "tracin"]


class FeaturesConfig(Strict):
    layer: int | None = Field(
        None,
        ge=1,
        description="Decoder layer whose mean hidden state is a row's feature vector "
        "(default: the middle one, more linearly decodable than the last).",
    )
    components: int = Field(
        32,
        ge=1,
        description="PCA dimensions of the features for the Shapley head and KNN: "
        "fewer make each head retraining faster, too few lose the signal.",
    )
    batch_size: int = Field(32, ge=1, description="Rows per forward pass (features, entropy).")


class ShapleyConfig(Strict):
    max_classes: int = Field(
        20,
        ge=2,
        description="Shapley methods run when the answers take 2..max_classes distinct "
        "values, at most half as many as rows (class labels); free-form answers get "
        "information and TracIn only.",
    )
    knn_k: int = Field(10, ge=1, description="Neighbours of the KNN classifier KNN-Shapley values.")
    permutations: int = Field(
        50,
        ge=1,
        description="Cap on TMC permutations; each costs up to one head retraining "
        "per row (fewer after truncation).",
    )
    min_permutations: int = Field(10, ge=1, description="Permutations before stopping is checked.")
    truncation: float = Field(
        0.02,
        ge=0.0,
        description="Stop a permutation once its prefix is within this fraction of "
        "the full utility; 0 disables truncation (unbiased, slower).",
    )
    tolerance: float = Field(
        0.05,
        ge=0.0,
        description="Stop once every value's standard error is below this times "
        "the average absolute value.",
    )
    beta_alpha: float = Field(16.0, gt=0.0, description="Beta-Shapley alpha (favours small sets).")
    beta_beta: float = Field(1.0, gt=0.0, description="Beta-Shapley beta; (1, 1) is Shapley.")


class TracInConfig(Strict):
    params: str = Field(
        "last",
        description="Parameters TracIn differentiates: `all`, `last` (last decoder "
        "layer and final norm) or a regex such as `lora_`. Fewer params, less memory.",
    )
    steps: int = Field(20, ge=1, description="Plain-SGD steps on the rows' answer tokens.")
    lr: float = Field(1e-3, gt=0.0, description="SGD learning rate (TracIn's step size).")
    batch_size: int = Field(8, ge=1, description="Rows per SGD step.")
    checkpoint_every: int = Field(5, ge=1, description="Steps between TracIn checkpoints.")
    projection: int | None = Field(
        16,
        ge=1,
        description="Random projection to k x k numbers per weight matrix (LoGra-"
        "style); null keeps full gradients (exact, memory grows with params).",
    )
    chunk: int = Field(8, ge=1, description="Rows per vmapped per-example gradient batch.")


class PricingConfig(Strict):
    weights: dict[str, float] = Field(
        default_factory=lambda: {
            "knn_shapley": 0.3,
            "tmc_shapley": 0.2,
            "beta_shapley": 0.1,
            "loo": 0.0,
            "tracin": 0.2,
            "information": 0.2,
        },
        description="Weight of each method's percentile rank in a row's utility; `information` "
        "is the mean surprisal in bits per token. Methods that did not run are left out.",
    )
    budget: float = Field(1000.0, gt=0.0, description="Total price of the valued rows.")
    floor: float = Field(0.0, ge=0.0, description="Minimum price of a row.")


class ValueConfig(Strict):
    """A valuation run: `leantrain value --config FILE` loads one of these."""

    data: Path | None = Field(None, description="JSONL rows: prompt, answer, optional source.")
    valid: Path | None = Field(None, description="Validation rows; default: a split of --data.")
    valid_fraction: float = Field(
        0.2, gt=0.0, lt=1.0, description="Share of --data held out when --valid is not given."
    )
    model: ModelConfig = Field(default_factory=ModelConfig)
    methods: list[Method] = Field(
        default_factory=lambda: ["knn_shapley", "tmc_shapley", "beta_shapley", "loo", "tracin"],
        description="Value methods to run (information is always measured).",
    )
    features: FeaturesConfig = Field(default_factory=FeaturesConfig)
    shapley: ShapleyConfig = Field(default_factory=ShapleyConfig)
    tracin: TracInConfig = Field(default_factory=TracInConfig)
    pricing: PricingConfig = Field(default_factory=PricingConfig)
    seed: int = Field(0, description="Seeds the split, permutations, SGD and projections.")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto picks CUDA.")
    out: Path = Field(Path("runs/value"), description="Output folder.")
