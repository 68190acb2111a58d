"""Shared fixtures. Tests run offline on the built-in tiny model, copied once per machine from the
build the package ships into the normal cache and reused; pytest-xdist workers wait on its file
lock. The engine
and speculation tests share a random-init tiny Llama (`model`), its byte tokenizer and prompts."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from leantrain.models.tiny_config import tiny_config
from leantrain.models.tokenizer import build_byte_tokenizer
from leantrain.rl.config import RLConfig
from leantrain.settings import load_settings
from leantrain.training.threads import claim_threads

TEXTS = [
    "sum 3 5 2 7\n",
    "hi",
    "sum 1 2 3 4 5 6 7 8 9 1 2 3\n",
    "x",
    "hello world, how are you",
    "ab",
    "The quick brown fox",
    "0123456789",
]


@pytest.fixture(scope="module", autouse=True)
def one_thread_per_module():
    # Two xdist workers on two cores: one intra-op thread each avoids oversubscription; and ops
    # on a 1 M-parameter model take microseconds, where a second thread only adds fan-out cost
    # (OpenMP spin-waits on a busy machine turn them into ms). Set per module, so a run that
    # changed the count (`threads:`) does not leak it into the next module. Claimed, not only
    # set: a worker registers as a leantrain process, so a command a test starts (the docs'
    # commands) takes its share of the cores beside the workers instead of all of them.
    claim_threads(1)


@pytest.fixture(scope="module")
def tok():
    return build_byte_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    """A random-init tiny Llama with a wide init (std 0.3, so greedy margins are far above
    batching noise)."""
    torch.manual_seed(0)
    config = tiny_config(tok)
    config.initializer_range = 0.3
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def prompts(tok):
    return [tok.encode(t) for t in TEXTS]


@pytest.fixture(scope="session")
def tiny_path() -> Path:
    from leantrain.models import ensure_tiny

    return ensure_tiny(progress=False)


@pytest.fixture
def small_rl_config(tiny_path: Path, tmp_path: Path) -> RLConfig:
    """A GRPO run on the tiny model small enough for a test: 4 prompts x 4 samples, 48 tokens."""
    return load_settings(
        RLConfig,
        None,
        **{
            "steps": 2,
            "out": tmp_path / "run",
            "device": "cpu",
            "task.eval_size": 8,
            "sampling.max_new_tokens": 48,
            "grpo.prompts_per_step": 4,
            "grpo.group_size": 4,
            "grpo.lr": 1e-3,
            "checkpoint_every": 1,
        },
    )


@pytest.fixture(scope="session")
def vllm_installed() -> None:
    """Skip a test that needs vLLM when it is missing, but fail it in CI, where `make test`
    installs vLLM: there a vLLM test must run."""
    if importlib.util.find_spec("vllm") is None:
        message = "vllm is not installed: run `make vllm`"
        if os.environ.get("CI"):
            pytest.fail(f"{message} (CI is set, so the vLLM tests must run)")
        pytest.skip(message)


@pytest.fixture(scope="session")
def ray_installed() -> None:
    """Skip a Ray test where ray is missing, but fail it in CI, which installs it."""
    if importlib.util.find_spec("ray") is None:
        if os.environ.get("CI"):
            pytest.fail("ray is missing (pip install 'leantrain[ray]')")
        pytest.skip("needs ray")
