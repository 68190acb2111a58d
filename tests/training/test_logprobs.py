"""The one token-logprob scorer: its arithmetic against a direct log_softmax, the padded-with-labels
forward against a plain full forward and against the RL learner's packed rows."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from leantrain.models import load_model
from leantrain.models.finetune import IGNORE
from leantrain.rl.packing import pack, packed_logprobs
from leantrain.rl.trajectory import Trajectory
from leantrain.training.logprobs import label_logprobs, token_logprobs


@pytest.mark.parametrize("temperature", [1.0, 0.7, 2.0])
def test_token_logprobs_equal_a_direct_log_softmax(tiny_path: Path, temperature: float) -> None:
    model, _ = load_model(tiny_path)
    ids = torch.randint(3, 259, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(input_ids=ids).logits  # (2, 9, V)
    targets = ids.roll(-1, dims=1)
    ours = token_logprobs(logits, targets, temperature)
    direct = torch.log_softmax(logits / temperature, -1).gather(-1, targets[..., None])[..., 0]
    assert ours.dtype == torch.float32 and ours.shape == (2, 9)
    torch.testing.assert_close(ours, direct, rtol=0, atol=2e-6)
    # bf16 logits are scored in fp32: the same numbers as their fp32 upcast, not bf16 ones.
    half = logits.bfloat16()
    torch.testing.assert_close(
        token_logprobs(half, targets, temperature),
        token_logprobs(half.float(), targets, temperature),
        rtol=0,
        atol=0,
    )
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(logits, targets, 0.0)


def test_label_logprobs_match_a_full_forward(tiny_path: Path) -> None:
    model, _ = load_model(tiny_path)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 259, (3, 12), generator=gen)
    labels = torch.full_like(ids, IGNORE)
    labels[0, 8:12] = ids[0, 8:12]  # a completion at the end
    labels[1, 5:9] = ids[1, 5:9]  # one in the middle, right padding after it
    labels[1, 9:] = IGNORE
    with torch.inference_mode():
        sums, counts = label_logprobs(model, ids, labels)
        logp = torch.log_softmax(model(input_ids=ids).logits.float(), -1)
    expected = torch.zeros(3)
    for row in range(3):
        for t in range(1, 12):
            if labels[row, t] != IGNORE:
                expected[row] += logp[row, t - 1, labels[row, t]]
    torch.testing.assert_close(sums, expected, rtol=1e-5, atol=1e-5)
    assert counts.tolist() == [4, 4, 0]  # row 2 has nothing to score: 0 and 0
    assert float(sums[2]) == 0.0


def test_label_logprobs_carry_the_gradient_of_the_token_mean_loss(tiny_path: Path) -> None:
    """Summed over rows and divided by the token count, they are minus HF's mean next-token
    loss, and so is their gradient (NPO trains through them)."""
    model, _ = load_model(tiny_path)
    ids = torch.randint(3, 259, (3, 10), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[:, :4] = IGNORE  # the prompt
    labels[2, 7:] = IGNORE  # a shorter answer, then padding
    sums, counts = label_logprobs(model, ids, labels)
    (-sums.sum() / counts.sum()).backward()
    ours = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    torch.testing.assert_close(-sums.sum().detach() / counts.sum(), loss.detach())
    for mine, param in zip(ours, model.parameters(), strict=True):
        torch.testing.assert_close(mine, param.grad, rtol=1e-4, atol=1e-6)


def test_padded_labels_and_packed_rows_give_the_same_numbers(tiny_path: Path) -> None:
    """The same (prompt, response) sequences scored right-padded with labels and packed into one
    row (the RL learner's layout): the same per-sequence sums."""
    model, _ = load_model(tiny_path)
    gen = torch.Generator().manual_seed(2)
    lengths = [(3, 6), (7, 2), (1, 5)]
    trajectories = []
    for p, r in lengths:
        prompt = torch.randint(3, 259, (p,), generator=gen).tolist()
        response = torch.randint(3, 259, (r,), generator=gen).tolist()
        trajectories.append(
            Trajectory(
                prompt_ids=[1, *prompt],
                response_ids=response,
                logprobs=[0.0] * r,
                versions=[0] * r,
                loss_mask=[1] * r,
                finish_reason="eos",
            )
        )
    width = max(len(t.prompt_ids) + len(t.response_ids) for t in trajectories)
    ids = torch.zeros(len(trajectories), width, dtype=torch.long)
    labels = torch.full_like(ids, IGNORE)
    for i, t in enumerate(trajectories):
        row = t.prompt_ids + t.response_ids
        ids[i, : len(row)] = torch.tensor(row)
        labels[i, len(t.prompt_ids) : len(row)] = torch.tensor(t.response_ids)
    batch = pack(trajectories, torch.zeros(len(trajectories)))
    with torch.inference_mode():
        padded, counts = label_logprobs(model, ids, labels)
        packed = packed_logprobs(model, batch)
    per_sequence = torch.zeros(len(trajectories)).index_add_(0, batch.sequence_index, packed)
    assert counts.tolist() == [r for _, r in lengths]
    torch.testing.assert_close(padded, per_sequence, rtol=1e-5, atol=1e-5)


def test_nothing_to_score_needs_no_forward(tiny_path: Path) -> None:
    model, _ = load_model(tiny_path)
    ids = torch.ones(2, 5, dtype=torch.long)
    sums, counts = label_logprobs(model, ids, torch.full_like(ids, IGNORE))
    assert sums.tolist() == [0.0, 0.0] and counts.tolist() == [0, 0]
