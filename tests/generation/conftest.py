"""What the vLLM backends' tests share: the tiny policy, its prompts, and the trainer's own
scorer on one fresh forward, the reference every vLLM logprob is checked against."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from leantrain.generation import Engine, SamplingParams
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


def _assert_serves_the_trained_policy(backend, run, prompt_texts: list[str], version: int) -> None:
    """After a GRPO `run` on `backend`, the backend holds the trained weights: its greedy
    output is the trainer model's own (the native engine on it), every token of `version`."""
    params = SamplingParams(temperature=0.0, max_new_tokens=32)
    prompts = [run.tokenizer.encode(t) for t in prompt_texts]
    expected = Engine(run.model, run.tokenizer).generate(prompts, params)
    got = backend.generate(prompts, params)
    assert [c.response_ids for c in got] == [c.response_ids for c in expected]
    assert {v for c in got for v in c.versions} == {version}


@pytest.fixture(scope="session")
def assert_serves_the_trained_policy() -> Callable[..., None]:
    return _assert_serves_the_trained_policy
