"""Fixtures shared by the engine and speculative-decoding tests: the byte tokenizer, a random-init
tiny Llama with a wide init (std 0.3, so greedy margins are far above batching noise), prompts."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM

from leantrain.models.tiny_config import tiny_config
from leantrain.models.tokenizer import build_byte_tokenizer

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
def single_thread():
    # Ops on a 1 M-parameter model take microseconds; a second intra-op thread only adds
    # fan-out cost, and on a busy 2-core machine OpenMP spin-waits turn microseconds into ms.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tok():
    return build_byte_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    torch.manual_seed(0)
    config = tiny_config(tok)
    config.initializer_range = 0.3
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def prompts(tok):
    return [tok.encode(t) for t in TEXTS]
