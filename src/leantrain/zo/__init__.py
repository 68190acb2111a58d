"""Zeroth-order fine-tuning (MeZO family) run as an inference workload: SPSA, n-SPSA and
one-sided estimators, sparse perturbations, LoRA or all-parameter targets, directions regenerated
from seeds, and every perturbed state scored as an inference engine scores a batch (`packed`:
each distinct prefix once; `training.logprobs` for models it does not cover);
`reference.MeZOReference` is the baseline it is measured against; `scoring` moves the scoring
(only) to vLLM with `zo.backend: vllm`."""

from leantrain.zo.data import Pair, label_accuracy, mean_loss, read_pairs
from leantrain.zo.directions import Directions, SeedStream, small_magnitude_masks
from leantrain.zo.engine import StepResult, ZOEngine
from leantrain.zo.estimators import ESTIMATORS, SPSA, OneSided, Plan, make_estimator
from leantrain.zo.lora import add_lora, lora_factors, stacked_adapters
from leantrain.zo.packed import LeanLlama, PrefixTree
from leantrain.zo.reference import MeZOReference

__all__ = [
    "ESTIMATORS",
    "SPSA",
    "Directions",
    "LeanLlama",
    "MeZOReference",
    "OneSided",
    "Pair",
    "Plan",
    "PrefixTree",
    "SeedStream",
    "StepResult",
    "ZOEngine",
    "add_lora",
    "label_accuracy",
    "lora_factors",
    "make_estimator",
    "mean_loss",
    "read_pairs",
    "small_magnitude_masks",
    "stacked_adapters",
]
