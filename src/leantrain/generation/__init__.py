"""The rollout engine: batched KV-cache decoding with continuous batching, sampling, logprobs and
hidden-state capture over any Hugging Face causal LM, and speculative decoding in the long tail
(drafters, bandit and online drafter training: `leantrain.speculation.long_tail.LongTail`)."""

from leantrain.generation.engine import Completion, Engine, FinishReason
from leantrain.generation.sampling import SamplingParams, sample
from leantrain.generation.speculative import SpeculativeConfig, Speculator

__all__ = [
    "Completion",
    "Engine",
    "FinishReason",
    "SamplingParams",
    "SpeculativeConfig",
    "Speculator",
    "sample",
]
