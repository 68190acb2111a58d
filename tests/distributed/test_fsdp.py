"""The single-process pieces of `leantrain.distributed`: the token-balanced split of a step's
micro-batches, which modules FSDP shards one by one, and the torchrun command line."""

from __future__ import annotations

import sys

import pytest
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from leantrain.distributed import balanced_split, decoder_layers, torchrun_command
from leantrain.errors import LeantrainError


def test_balanced_split_deals_largest_first_to_the_lightest_bin_with_room() -> None:
    # At most ceil(6 / 2) = 3 per bin. 10 -> bin 0 (a tie: the lower bin); 9 -> bin 1 (0 < 10);
    # 8 -> bin 1 (9 < 10); two 1s -> bin 0 (10 < 17, 11 < 17), now full; the last 1 -> bin 1.
    assert balanced_split([1, 9, 10, 1, 8, 1], 2) == [[0, 2, 3], [1, 4, 5]]


@pytest.mark.parametrize("n, parts", [(1, 2), (5, 2), (7, 3), (16, 4)])
def test_balanced_split_uses_every_index_once_with_counts_one_apart(n: int, parts: int) -> None:
    sizes = [(i * 37) % 11 + 1 for i in range(n)]
    bins = balanced_split(sizes, parts)
    assert len(bins) == parts
    assert sorted(i for b in bins for i in b) == list(range(n))
    counts = [len(b) for b in bins]
    assert max(counts) - min(counts) <= 1
    assert all(b == sorted(b) for b in bins)
    assert balanced_split(sizes, parts) == bins  # every rank computes the same split


def test_decoder_layers_are_the_no_split_modules() -> None:
    config = LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    model = LlamaForCausalLM(config)
    assert decoder_layers(model) == list(model.model.layers)
    with pytest.raises(LeantrainError, match="names no decoder layer class"):
        decoder_layers(nn.Linear(2, 2))


def test_torchrun_command_runs_this_interpreter_standalone() -> None:
    command = torchrun_command(2, ["-m", "leantrain", "rl", "--steps", "2"])
    assert command == [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "-m",
        "leantrain",
        "rl",
        "--steps",
        "2",
    ]
