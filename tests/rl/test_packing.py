import pytest
import torch
from torch.testing import assert_close
from transformers import LlamaForCausalLM

from leantrain.models.tiny_config import tiny_config
from leantrain.models.tokenizer import build_byte_tokenizer
from leantrain.rl.losses import policy_loss
from leantrain.rl.packing import (
    loss_context,
    micro_batches,
    pack,
    packed_logprobs,
    padded_logprobs,
    padding_fraction,
    token_metrics,
)
from leantrain.rl.trajectory import FinishReason, Trajectory


def _traj(
    prompt: list[int],
    response: list[int],
    finish_reason: FinishReason = "eos",
    loss_mask: list[int] | None = None,
    logprobs: list[float] | None = None,
) -> Trajectory:
    return Trajectory(
        prompt_ids=prompt,
        response_ids=response,
        logprobs=logprobs if logprobs is not None else [-1.0] * len(response),
        versions=[0] * len(response),
        loss_mask=loss_mask if loss_mask is not None else [1] * len(response),
        finish_reason=finish_reason,
    )


def test_pack_layout_by_hand():
    """A = prompt [5, 6] + response [7, 8, 9]; B = prompt [10] + response [11, 12].

    row           5  6  7  8  9 10 11 12
    position      0  1  2  3  4  0  1  2
    Response tokens sit at 2, 3, 4, 6, 7 and are predicted from one position earlier.
    """
    trajs = [
        _traj([5, 6], [7, 8, 9], loss_mask=[1, 0, 1], logprobs=[-0.1, -0.2, -0.3]),
        _traj([10], [11, 12], logprobs=[-0.4, -0.5]),
    ]
    batch = pack(trajs, torch.tensor([0.5, -1.0]))
    assert batch.input_ids.tolist() == [[5, 6, 7, 8, 9, 10, 11, 12]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2]]
    assert batch.logit_positions.tolist() == [1, 2, 3, 5, 6]
    assert batch.targets.tolist() == [7, 8, 9, 11, 12]
    assert batch.sequence_index.tolist() == [0, 0, 0, 1, 1]
    assert batch.num_sequences == 2
    assert_close(batch.old_logprobs, torch.tensor([-0.1, -0.2, -0.3, -0.4, -0.5]))
    assert_close(batch.loss_mask, torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0]))
    assert_close(batch.advantages, torch.tensor([0.5, 0.5, 0.5, -1.0, -1.0]))
    # The invariant: the token after each logit position is the target.
    assert batch.input_ids[0, batch.logit_positions + 1].tolist() == batch.targets.tolist()


def test_mask_truncated_zeroes_only_truncated_trajectories():
    """Only the "length" trajectory's tokens lose their mask; its tool-token zero stays."""
    trajs = [
        _traj([1], [3, 4], finish_reason="eos"),
        _traj([1], [5, 6, 7], finish_reason="length"),
        _traj([1], [8], finish_reason="stop", loss_mask=[0]),
    ]
    masked = pack(trajs, torch.zeros(3), mask_truncated=True)
    kept = pack(trajs, torch.zeros(3), mask_truncated=False)
    assert masked.loss_mask.tolist() == [1, 1, 0, 0, 0, 0]
    assert kept.loss_mask.tolist() == [1, 1, 1, 1, 1, 0]


def test_loss_context_counts_the_whole_step():
    """Masked truncated trajectories still count as sequences, not as active tokens."""
    batches = [
        pack([_traj([1], [3, 4]), _traj([1], [5], "length")], torch.zeros(2), True),
        pack([_traj([1], [6, 7, 8], loss_mask=[1, 0, 1])], torch.zeros(1), True),
    ]
    ctx = loss_context(batches, max_completion_length=16)
    assert (ctx.num_sequences, ctx.num_active_tokens) == (3, 4)
    assert (ctx.max_completion_length, ctx.num_micro_batches) == (16, 2)


def test_pack_rejects_bad_input():
    with pytest.raises(ValueError, match="advantages"):
        pack([_traj([1], [2])], torch.zeros(2))
    with pytest.raises(ValueError, match="prompt_ids"):
        pack([_traj([], [2])], torch.zeros(1))


def test_micro_batches_first_fit_decreasing_by_hand():
    """Lengths 5, 3, 8, 2, 12 with budget 10, longest first:
    12 -> alone (over budget); 8 -> new group (room 2); 5 -> new group (room 5);
    3 -> joins 5 (room 2); 2 -> first group with room: joins 8."""
    lengths = [5, 3, 8, 2, 12]
    trajs = [_traj([1] * (n - 1), [2]) for n in lengths]
    assert micro_batches(trajs, max_tokens=10) == [[4], [2, 3], [0, 1]]


def test_micro_batches_respect_the_budget_and_keep_each_trajectory_once():
    gen = torch.Generator().manual_seed(0)
    sizes = torch.randint(1, 40, (60, 2), generator=gen).tolist()
    trajs = [_traj([1] * p, [2] * r) for p, r in sizes]
    groups = micro_batches(trajs, max_tokens=64)
    assert sorted(i for group in groups for i in group) == list(range(len(trajs)))
    for group in groups:
        tokens = sum(len(trajs[i].prompt_ids) + len(trajs[i].response_ids) for i in group)
        assert tokens <= 64 or len(group) == 1


@pytest.fixture(scope="module")
def tokenizer():
    return build_byte_tokenizer()


def _tiny_model(tokenizer, attn_implementation: str) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = tiny_config(tokenizer)
    config._attn_implementation = attn_implementation
    return LlamaForCausalLM(config)


def _random_trajectories(n: int, seed: int) -> list[Trajectory]:
    """Trajectories with different prompt and response lengths over the 259-token vocabulary."""
    gen = torch.Generator().manual_seed(seed)
    trajs = []
    for i in range(n):
        prompt = torch.randint(3, 259, (3 + 2 * i,), generator=gen).tolist()
        response = torch.randint(3, 259, (7 - i,), generator=gen).tolist()
        trajs.append(_traj([1, *prompt], response))
    return trajs


def _unpacked_logprobs(model, trajs: list[Trajectory], temperature: float) -> torch.Tensor:
    """Reference: one plain forward per trajectory, log_softmax(logits / T) at the response."""
    out = []
    for traj in trajs:
        ids = torch.tensor([traj.prompt_ids + traj.response_ids])
        logits = model(ids).logits[0, len(traj.prompt_ids) - 1 : -1] / temperature
        targets = torch.tensor(traj.response_ids)
        out.append(torch.log_softmax(logits, -1).gather(-1, targets[:, None]).squeeze(-1))
    return torch.cat(out)


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_packed_logprobs_match_unpacked_forwards(tokenizer, attn_implementation, temperature):
    """Packed sequences must not attend to each other: logprobs equal per-sequence forwards."""
    model = _tiny_model(tokenizer, attn_implementation)
    trajs = _random_trajectories(4, seed=1)
    batch = pack(trajs, torch.zeros(len(trajs)))
    with torch.no_grad():
        packed = packed_logprobs(model, batch, temperature=temperature)
        reference = _unpacked_logprobs(model, trajs, temperature)
    assert packed.shape == batch.targets.shape
    assert (packed - reference).abs().max() < 1e-5


def test_packed_logprobs_respect_temperature(tokenizer):
    model = _tiny_model(tokenizer, "sdpa")
    batch = pack(_random_trajectories(2, seed=2), torch.zeros(2))
    with torch.no_grad():
        hot = packed_logprobs(model, batch, temperature=2.0)
        cold = packed_logprobs(model, batch, temperature=1.0)
    assert (hot - cold).abs().max() > 1e-3


def test_packed_logprobs_gradients_match_unpacked(tokenizer):
    """Gradients flow through the packed forward and equal the unpacked ones."""
    model = _tiny_model(tokenizer, "sdpa")
    trajs = _random_trajectories(3, seed=3)
    packed_logprobs(model, pack(trajs, torch.zeros(3)), temperature=0.9).sum().backward()
    packed_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    _unpacked_logprobs(model, trajs, temperature=0.9).sum().backward()
    for packed_grad, param in zip(packed_grads, model.parameters(), strict=True):
        assert packed_grad.abs().sum() > 0
        assert_close(packed_grad, param.grad, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
def test_micro_batched_step_equals_one_packed_batch(tokenizer, loss_type):
    """End to end on the tiny model: pack -> logprobs -> loss, split by a token budget and
    accumulated, gives the loss and gradient of the whole batch packed as one."""
    model = _tiny_model(tokenizer, "sdpa")
    trajs = _random_trajectories(5, seed=4)
    trajs[1].finish_reason = "length"
    advantages = torch.tensor([1.0, -0.5, 0.3, -1.2, 0.4])

    def step(groups: list[list[int]]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        model.zero_grad()
        batches = [pack([trajs[i] for i in g], advantages[g], mask_truncated=True) for g in groups]
        ctx = loss_context(batches, max_completion_length=8)
        total = torch.zeros(())
        for b in batches:
            logp = packed_logprobs(model, b)
            loss, _ = policy_loss(
                logp, b.old_logprobs, b.advantages, b.loss_mask, b.sequence_index, ctx, loss_type
            )
            loss.backward()
            total = total + loss.detach()
        return total, [p.grad.clone() for p in model.parameters()]

    # Row lengths 11..15 under a budget of 28: groups [2, 4], [1, 3], [0].
    groups = micro_batches(trajs, max_tokens=28)
    assert len(groups) == 3
    split_loss, split_grads = step(groups)
    whole_loss, whole_grads = step([list(range(len(trajs)))])
    assert_close(split_loss, whole_loss)
    for split_grad, whole_grad in zip(split_grads, whole_grads, strict=True):
        assert_close(split_grad, whole_grad, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("reason", ["budget", "max_turns"])
def test_mask_truncated_covers_episode_limits(reason):
    """An episode cut by its token budget or turn limit is as unfinished as a "length" one."""
    batch = pack([_traj([1], [3, 4], finish_reason=reason)], torch.zeros(1), mask_truncated=True)
    assert batch.loss_mask.tolist() == [0, 0]


def test_padding_fraction_and_token_metrics_by_hand():
    """A: prompt 2 + response 3 (env token masked), finished; B: prompt 1 + response 1, budget.

    One group [A, B] (budget 16). Packed: 7 real tokens in 7 slots -> 0 padding. Padded: 2 rows
    of (max prompt 2 + max response 3) = 10 slots, 7 real -> 0.3 padding.
    """
    trajs = [
        _traj([1, 5], [6, 7, 8], loss_mask=[1, 0, 1]),
        _traj([1], [9], finish_reason="budget"),
    ]
    groups = micro_batches(trajs, max_tokens=16)
    assert groups == [[0, 1]]
    assert padding_fraction(trajs, groups, packed=True) == 0.0
    assert padding_fraction(trajs, groups, packed=False) == pytest.approx(0.3)
    assert token_metrics(trajs, micro_batch_tokens=16) == {
        "generated_tokens": 3.0,
        "env_tokens": 1.0,
        "truncated_tokens": 1.0,
        "padding_fraction": 0.0,
        "padding_fraction_padded": pytest.approx(0.3),
    }


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_padded_logprobs_equal_packed_ones(tokenizer, temperature):
    """The benchmark's baseline computes the same numbers as packing, in the same order."""
    model = _tiny_model(tokenizer, "sdpa")
    trajs = _random_trajectories(4, seed=5)
    with torch.no_grad():
        packed = packed_logprobs(model, pack(trajs, torch.zeros(4)), temperature=temperature)
        padded = padded_logprobs(model, trajs, temperature=temperature)
    assert padded.shape == packed.shape
    assert (padded - packed).abs().max() < 1e-5
