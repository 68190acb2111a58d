"""The rollout engine: batched KV-cache decoding with continuous batching, sampling, logprobs and
hidden-state capture over any Hugging Face causal LM."""

from leantrain.generation.engine import Completion, Engine, FinishReason
from leantrain.generation.sampling import SamplingParams, sample

__all__ = ["Completion", "Engine", "FinishReason", "SamplingParams", "sample"]
