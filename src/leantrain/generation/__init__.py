"""Inference only: the rollout `Backend` protocol and its capabilities; the native engine
(batched KV-cache decoding with continuous batching, sampling, logprobs and hidden-state capture
over any Hugging Face causal LM) with lossless speculative verification behind the `Speculator`
protocol (the drafters, the bandit and the long-tail switch: `leantrain.speculation`)."""

from leantrain.generation.backend import (
    Backend,
    Capabilities,
    Completion,
    FinishReason,
    require,
    weights_snapshot,
)
from leantrain.generation.config import SamplingParams
from leantrain.generation.engine import Engine
from leantrain.generation.sampling import sample
from leantrain.generation.speculative import Speculator

__all__ = [
    "Backend",
    "Capabilities",
    "Completion",
    "Engine",
    "FinishReason",
    "SamplingParams",
    "Speculator",
    "require",
    "sample",
    "weights_snapshot",
]
