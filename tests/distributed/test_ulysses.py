"""Ulysses sequence parallelism with 2 and 4 gloo processes against the single-process model.

Each world size is one `torch.multiprocessing.spawn`: every rank builds the same tiny Llama
(4 query heads, 2 KV heads, so P=4 exercises the repeated-KV path), checks the all-to-all
directly, then runs the model sequence-parallel on a batch whose length (13) leaves an uneven last
shard, and compares logits, loss and gradients with the same model run whole in the same process.
A failed assertion in any rank fails the spawn, and so the test.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import LlamaConfig, LlamaForCausalLM

from leantrain.distributed import (
    check_heads,
    heads_to_seq,
    seq_to_heads,
    sequence_parallel_backward,
    shard_batch,
)
from leantrain.distributed.launch import free_port
from leantrain.distributed.sequence import SequenceParallelHooks
from leantrain.errors import LeantrainError
from leantrain.models.finetune import IGNORE

LENGTH = 13  # not divisible by 2 or 4: the last shard is padded
PAD = 0


def _tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=40,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config).float()


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 40, (2, LENGTH), generator=g)
    labels = ids.clone()
    labels[:, :3] = IGNORE  # a prompt: no loss on its tokens
    labels[1, -2:] = IGNORE  # right padding of the second row
    return ids, labels


def _check_all_to_all(rank: int, world: int) -> None:
    # value = 1000·head + 10·global position + feature: says exactly where it came from
    heads, local, dim = 4, 3, 2
    pos = torch.arange(rank * local, (rank + 1) * local)
    x = (
        1000 * torch.arange(heads).view(1, heads, 1, 1)
        + 10 * pos.view(1, 1, local, 1)
        + torch.arange(dim).view(1, 1, 1, dim)
    ).float()
    swapped = seq_to_heads(x)  # (1, heads/P, P·local, dim)
    own = heads // world
    expected = (
        1000 * torch.arange(rank * own, (rank + 1) * own).view(1, own, 1, 1)
        + 10 * torch.arange(world * local).view(1, 1, -1, 1)
        + torch.arange(dim).view(1, 1, 1, dim)
    ).float()
    assert torch.equal(swapped, expected), f"rank {rank}: heads or positions landed wrong"
    assert torch.equal(heads_to_seq(swapped), x), "round trip is not the identity"


def _worker(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        _check_all_to_all(rank, world)
        ids, labels = _batch()

        reference = _tiny_llama()
        ref_out = reference(input_ids=ids, labels=labels)
        ref_out.loss.backward()

        model = _tiny_llama()

        class _Tok:
            pad_token_id = PAD

        SequenceParallelHooks().attach(model, _Tok())  # type: ignore[arg-type]
        local_ids, positions, _ = shard_batch(ids, labels, rank, world, PAD)
        with torch.no_grad():
            logits = model(input_ids=local_ids, position_ids=positions).logits
        local = logits.shape[1]
        start, stop = rank * local, min((rank + 1) * local, LENGTH)
        if stop > start:
            diff = (logits[:, : stop - start] - ref_out.logits[:, start:stop]).abs().max()
            assert diff < 1e-5, f"rank {rank}: logits differ by {diff}"

        loss = sequence_parallel_backward(model, [(ids, labels)], PAD)
        assert abs(loss - float(ref_out.loss)) < 1e-5, f"loss {loss} vs {float(ref_out.loss)}"
        for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
            diff = (p.grad - q.grad).abs().max()
            assert diff < 1e-5, f"rank {rank}: grad of {name} differs by {diff}"
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_ulysses_matches_single_process(world: int) -> None:
    mp.spawn(_worker, args=(world, free_port()), nprocs=world, join=True)


def test_shard_batch_shifts_labels_globally_and_pads_the_last_shard() -> None:
    ids = torch.arange(1, 6).view(1, 5)  # tokens 1..5, 2 ranks -> 3 + 3 (one pad)
    labels = ids.clone()
    first = shard_batch(ids, labels, 0, 2, PAD)
    second = shard_batch(ids, labels, 1, 2, PAD)
    assert first[0].tolist() == [[1, 2, 3]] and second[0].tolist() == [[4, 5, PAD]]
    assert first[1].tolist() == [[0, 1, 2]] and second[1].tolist() == [[3, 4, 5]]
    # the label of shard 0's last token is shard 1's first token
    assert first[2].tolist() == [[2, 3, 4]]
    assert second[2].tolist() == [[5, IGNORE, IGNORE]]


def test_heads_not_divisible_names_valid_sizes() -> None:
    check_heads(9, 3)
    with pytest.raises(LeantrainError, match=r"valid sizes: \[1, 3, 9\]"):
        check_heads(9, 2)
