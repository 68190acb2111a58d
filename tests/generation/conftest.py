"""What the vLLM backends' tests share: the tiny policy, its prompts, and the trainer's own
scorer on one fresh forward, the reference every vLLM logprob is checked against."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from leantrain.models import load_model
from leantrain.training.logprobs import token_logprobs

# Rows of different lengths, so batches mix prompt lengths.
PROMPTS = ["sum 3 5 2 7\n", "sum 1 2\n", "sum 9 9 9 4\n", "sum 6\n"]


@pytest.fixture(scope="module")
def policy(tiny_path):
    """The tiny preset as the trainer holds it: (model, tokenizer)."""
    return load_model(tiny_path)


@pytest.fixture(scope="module")
def prompt_texts() -> list[str]:
    return list(PROMPTS)


@pytest.fixture(scope="module")
def prompt_ids(policy, prompt_texts) -> list[list[int]]:
    _, tok = policy
    return [tok.encode(t) for t in prompt_texts]


def _trainer_logprobs(
    model: torch.nn.Module, prompt: list[int], response: list[int], temperature: float
) -> torch.Tensor:
    """The trainer's scorer on one fresh forward over prompt + response: (len(response),)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1]
    return token_logprobs(logits, torch.tensor(response), temperature)


@pytest.fixture(scope="session")
def trainer_logprobs() -> Callable[..., torch.Tensor]:
    return _trainer_logprobs
