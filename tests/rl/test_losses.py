"""GRPO's arithmetic against closed-form values: group advantages, the policy losses and their
normalisations, the off-policy corrections."""

import itertools
import math

import pytest
import torch
from torch.testing import assert_close

from leantrain.rl.losses import (
    LOSS_WEIGHTS,
    LossContext,
    correction_inputs,
    group_advantages,
    k3_kl,
    per_token_policy_loss,
    policy_loss,
    truncated_is_loss,
)


def _logp_for_ratios(ratios: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """(logp leaf with grad, old_logp) such that exp(logp - old_logp) = ratios."""
    old_logp = torch.full((len(ratios),), -1.0)
    logp = (old_logp + torch.tensor(ratios).log()).requires_grad_()
    return logp, old_logp


def test_per_token_loss_inside_and_outside_the_clip_range():
    """l = -min(r A, clip(r, 0.8, 1.2) A), epsilon = 0.2:

    r=1.0, A=+1: -min(1.0, 1.0)   = -1.0  inside
    r=1.5, A=+1: -min(1.5, 1.2)   = -1.2  clipped high (gradient 0)
    r=0.5, A=-1: -min(-0.5, -0.8) =  0.8  clipped low (gradient 0)
    r=1.1, A=-1: -min(-1.1, -1.1) =  1.1  inside
    r=1.5, A=-1: -min(-1.5, -1.2) =  1.5  outside, but the clip only binds towards A: unclipped
    r=0.5, A=+1: -min(0.5, 0.8)   = -0.5  likewise unclipped
    Unclipped gradient: dl/dlogp = -A r.
    """
    logp, old_logp = _logp_for_ratios([1.0, 1.5, 0.5, 1.1, 1.5, 0.5])
    advantages = torch.tensor([1.0, 1.0, -1.0, -1.0, -1.0, 1.0])
    loss, stats = per_token_policy_loss(logp, old_logp, advantages, epsilon=0.2)
    assert_close(loss, torch.tensor([-1.0, -1.2, 0.8, 1.1, 1.5, -0.5]))
    assert stats["clipped_high"].tolist() == [False, True, False, False, False, False]
    assert stats["clipped_low"].tolist() == [False, False, True, False, False, False]
    assert_close(stats["ratio"], torch.tensor([1.0, 1.5, 0.5, 1.1, 1.5, 0.5]))
    loss.sum().backward()
    assert_close(logp.grad, torch.tensor([-1.0, 0.0, 0.0, 1.1, 1.5, -0.5]))


def test_epsilon_high_widens_only_the_upper_bound():
    """epsilon=0.2, epsilon_high=0.28: clip range [0.8, 1.28].

    r=1.25, A=+1: symmetric -> -1.2 (clipped); asymmetric -> -1.25 (inside)
    r=1.5,  A=+1: symmetric -> -1.2;           asymmetric -> -1.28
    r=0.5,  A=-1: 0.8 either way (lower bound unchanged)
    """
    logp, old_logp = _logp_for_ratios([1.25, 1.5, 0.5])
    advantages = torch.tensor([1.0, 1.0, -1.0])
    symmetric, _ = per_token_policy_loss(logp, old_logp, advantages, epsilon=0.2)
    asymmetric, stats = per_token_policy_loss(
        logp, old_logp, advantages, epsilon=0.2, epsilon_high=0.28
    )
    assert_close(symmetric, torch.tensor([-1.2, -1.2, 0.8]))
    assert_close(asymmetric, torch.tensor([-1.25, -1.28, 0.8]))
    assert stats["clipped_high"].tolist() == [False, True, False]


def test_k3_kl_hand_value_and_zero_at_equality():
    """k3 = exp(ref - logp) - (ref - logp) - 1.

    logp = log 0.5, ref = log 0.25: ref - logp = log 0.5 -> 0.5 - log 0.5 - 1 = log 2 - 0.5.
    Swapped: ref - logp = log 2 -> 2 - log 2 - 1 = 1 - log 2. Equal logprobs -> 0.
    """
    logp = torch.tensor([math.log(0.5), math.log(0.25), -3.0])
    ref_logp = torch.tensor([math.log(0.25), math.log(0.5), -3.0])
    expected = torch.tensor([math.log(2) - 0.5, 1 - math.log(2), 0.0])
    assert_close(k3_kl(logp, ref_logp), expected)


# Three sequences of different lengths; the masked token carries a loss that must not count.
#   seq 0: l = [1, 2],      mask [1, 1]
#   seq 1: l = [3, 100, 5], mask [1, 0, 1]
#   seq 2: l = [4],         mask [1]
LOSS = torch.tensor([1.0, 2.0, 3.0, 100.0, 5.0, 4.0])
MASK = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 1.0])
SEQ = torch.tensor([0, 0, 1, 1, 1, 2])
CTX = LossContext(num_sequences=3, num_active_tokens=5, max_completion_length=4)


@pytest.mark.parametrize(
    ("loss_type", "expected"),
    [
        # per-sequence means 3/2, 8/2, 4/1, then their mean: (1.5 + 4 + 4) / 3
        ("grpo", 9.5 / 3),
        # active sum 1 + 2 + 3 + 5 + 4 = 15 over N * L = 3 * 4
        ("dr_grpo", 15 / 12),
        # active sum over active tokens of the whole batch: 15 / 5
        ("dapo", 3.0),
        # one micro-batch: active sum over its active tokens, 15 / 5
        ("bnpo", 3.0),
    ],
)
def test_normalization_hand_values(loss_type, expected):
    """Batch loss = sum_t w_t l_t with each variant's weights (formulas in losses.py)."""
    weights = LOSS_WEIGHTS[loss_type](MASK, SEQ, CTX)
    assert_close((weights * LOSS).sum(), torch.tensor(expected))


def test_policy_loss_on_policy_is_minus_mean_advantage():
    """At ratio 1 every token's loss is -A, so grpo gives -mean_i A_i over the sequences:
    A = (1, -2, 0.5) -> -(1 - 2 + 0.5) / 3 = 1/6, whatever the lengths and masks."""
    logp = torch.full((6,), -0.7)
    advantages = torch.tensor([1.0, 1.0, -2.0, -2.0, -2.0, 0.5])
    loss, stats = policy_loss(logp, logp, advantages, MASK, SEQ, CTX, loss_type="grpo")
    assert_close(loss, torch.tensor(1 / 6))
    assert_close(stats["ratio_mean"], torch.tensor(1.0))
    assert_close(stats["clip_fraction"], torch.tensor(0.0))
    assert_close(stats["active_tokens"], torch.tensor(5.0))
    assert "kl_mean" not in stats


def test_policy_loss_stats_count_active_tokens_only():
    """Ratios (1.5, 1.0, 0.5, 9.0, 1.0, 1.0) with A = +1: only token 0 is clipped (high); token
    3 would be too but is masked. clip_fraction = 1/5, ratio_mean = (1.5 + 1 + 0.5 + 1 + 1) / 5."""
    logp, old_logp = _logp_for_ratios([1.5, 1.0, 0.5, 9.0, 1.0, 1.0])
    _, stats = policy_loss(logp, old_logp, torch.ones(6), MASK, SEQ, CTX)
    assert_close(stats["clip_fraction"], torch.tensor(0.2))
    assert_close(stats["clip_high_fraction"], torch.tensor(0.2))
    assert_close(stats["clip_low_fraction"], torch.tensor(0.0))
    assert_close(stats["ratio_mean"], torch.tensor(1.0))


def test_policy_loss_adds_beta_times_k3():
    """Ratio 1 and A = 0: the policy term is 0, so the dapo loss is beta * mean k3 over active
    tokens; with ref - logp = log 0.5 on every token that is 0.1 * (log 2 - 0.5)."""
    logp = torch.full((6,), math.log(0.5))
    ref_logp = torch.full((6,), math.log(0.25))
    loss, stats = policy_loss(
        logp, logp, torch.zeros(6), MASK, SEQ, CTX, beta=0.1, ref_logp=ref_logp
    )
    assert_close(loss, torch.tensor(0.1 * (math.log(2) - 0.5)))
    assert_close(stats["kl_mean"], torch.tensor(math.log(2) - 0.5))


def test_masked_tokens_with_garbage_logprobs_do_not_poison_gradients():
    """A masked token whose old/ref logprob is -inf or huge contributes nothing, not NaN."""
    logp = torch.zeros(6, requires_grad=True)
    old_logp = torch.tensor([0.0, 0.0, 0.0, -float("inf"), 0.0, 0.0])
    ref_logp = torch.tensor([0.0, 0.0, 0.0, 1e4, 0.0, 0.0])
    loss, _ = policy_loss(
        logp, old_logp, torch.ones(6), MASK, SEQ, CTX, beta=0.1, ref_logp=ref_logp
    )
    loss.backward()
    assert torch.isfinite(loss)
    assert torch.isfinite(logp.grad).all()
    assert logp.grad[3] == 0


def _random_batch(seed: int) -> dict[str, torch.Tensor]:
    """Five sequences of lengths 3, 1, 4, 2, 5 with random logprobs, advantages and masks."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([3, 1, 4, 2, 5])
    n = int(lengths.sum())
    mask = (torch.rand(n, generator=gen) > 0.3).float()
    mask[3] = 0.0  # sequence 1 (its only token) fully masked: still counts as a sequence
    return {
        "logp": -torch.rand(n, generator=gen) * 3,
        "old_logp": -torch.rand(n, generator=gen) * 3,
        "ref_logp": -torch.rand(n, generator=gen) * 3,
        "advantages": torch.randn(5, generator=gen).repeat_interleave(lengths),
        "mask": mask,
        "seq": torch.arange(5).repeat_interleave(lengths),
    }


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("split", [[0, 15], [0, 4, 15], [0, 3, 4, 8, 10, 15]])
def test_micro_batches_accumulate_to_the_full_batch(loss_type, split):
    """sum over micro-batches of their losses (and gradients) = full-batch loss (gradient),
    for any split at sequence boundaries, uneven sizes included. Token boundaries
    [0, 3, 4, 8, 10, 15] are the sequence boundaries of lengths 3, 1, 4, 2, 5."""
    batch = _random_batch(seed=0)
    ctx = LossContext(
        num_sequences=5,
        num_active_tokens=int(batch["mask"].sum()),
        max_completion_length=6,
        num_micro_batches=len(split) - 1,
    )
    kwargs = {"loss_type": loss_type, "epsilon": 0.2, "epsilon_high": 0.28, "beta": 0.05}

    full_logp = batch["logp"].clone().requires_grad_()
    full, _ = policy_loss(
        full_logp,
        batch["old_logp"],
        batch["advantages"],
        batch["mask"],
        batch["seq"],
        ctx,
        ref_logp=batch["ref_logp"],
        **kwargs,
    )
    full.backward()

    micro_logp = batch["logp"].clone().requires_grad_()
    total = torch.zeros(())
    for start, end in itertools.pairwise(split):
        part = slice(start, end)
        seq = batch["seq"][part] - batch["seq"][start]  # indices local to the micro-batch
        loss, _ = policy_loss(
            micro_logp[part],
            batch["old_logp"][part],
            batch["advantages"][part],
            batch["mask"][part],
            seq,
            ctx,
            ref_logp=batch["ref_logp"][part],
            **kwargs,
        )
        loss.backward()
        total = total + loss.detach()

    assert_close(total, full.detach())
    assert_close(micro_logp.grad, full_logp.grad)


def test_bnpo_averages_micro_batch_token_means():
    """bnpo = mean over micro-batches of (sum of active l) / (active tokens in it).

    Micro-batch A = seqs 0, 1: active l 1, 2, 3, 5 -> 11/4; B = seq 2: 4/1.
    bnpo = (11/4 + 4) / 2 = 3.375, unlike dapo's 15/5 = 3: it depends on the split.
    """
    ctx = LossContext(num_sequences=3, num_active_tokens=5, num_micro_batches=2)
    bnpo = LOSS_WEIGHTS["bnpo"]
    part_a = (bnpo(MASK[:5], SEQ[:5], ctx) * LOSS[:5]).sum()
    part_b = (bnpo(MASK[5:], SEQ[5:] - 2, ctx) * LOSS[5:]).sum()
    assert_close(part_a + part_b, torch.tensor(3.375))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"loss_type": "ppo"}, "loss_type"),
        ({"beta": 0.1}, "ref_logp"),
        (
            {"loss_type": "dr_grpo", "ctx": LossContext(num_sequences=3, num_active_tokens=5)},
            "max_completion_length",
        ),
    ],
)
def test_bad_loss_arguments_raise(kwargs, match):
    args = {
        "logp": torch.zeros(6),
        "old_logp": torch.zeros(6),
        "advantages": torch.ones(6),
        "loss_mask": MASK,
        "sequence_index": SEQ,
        "ctx": CTX,
        **kwargs,
    }
    with pytest.raises(ValueError, match=match):
        policy_loss(**args)


def test_loss_context_rejects_an_empty_batch():
    with pytest.raises(ValueError, match="num_sequences"):
        LossContext(num_sequences=0, num_active_tokens=0)


# ----------------------------------------------------------- advantages
# Six trajectories in three groups with arbitrary, non-contiguous ids:
#   group 7: indices 0, 1, 3 -> rewards 1, 0, 1   mean 2/3  centred  1/3, -2/3, 1/3
#   group 3: indices 2, 4    -> rewards 0, 1      mean 1/2  centred -1/2,  1/2
#   group 9: index 5         -> reward 0.5        a group of one, centred 0
REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.5])
GROUP_IDS = torch.tensor([7, 7, 3, 7, 3, 9])
CENTRED = torch.tensor([1 / 3, -2 / 3, -1 / 2, 1 / 3, 1 / 2, 0.0])
EPS = 1e-4


def test_scale_none_only_centres():
    """Dr. GRPO: A_i = r_i - mean_group(r), no std and no eps."""
    assert_close(group_advantages(REWARDS, GROUP_IDS, scale="none"), CENTRED)


def test_scale_group_divides_by_unbiased_group_std():
    """A_i = (r_i - mean_g) / (std_g + eps) with std_g = sqrt(sum (r - mean_g)^2 / (n_g - 1)):

    group 7: sum of squares 1/9 + 4/9 + 1/9 = 2/3, over n - 1 = 2 -> std = sqrt(1/3)
    group 3: 1/4 + 1/4 = 1/2, over 1 -> std = sqrt(1/2)
    group 9: one member -> advantage 0
    """
    s7, s3 = math.sqrt(1 / 3), math.sqrt(1 / 2)
    expected = torch.tensor(
        [
            (1 / 3) / (s7 + EPS),
            (-2 / 3) / (s7 + EPS),
            (-1 / 2) / (s3 + EPS),
            (1 / 3) / (s7 + EPS),
            (1 / 2) / (s3 + EPS),
            0.0,
        ]
    )
    assert_close(group_advantages(REWARDS, GROUP_IDS, scale="group", eps=EPS), expected)


def test_group_std_is_torch_std_convention():
    """The group std is torch.std (Bessel-corrected), as TRL's nanstd."""
    advantages = group_advantages(REWARDS, GROUP_IDS, scale="group", eps=EPS)
    group = REWARDS[[0, 1, 3]]
    assert_close(advantages[[0, 1, 3]], (group - group.mean()) / (group.std() + EPS))


def test_scale_batch_divides_by_unbiased_batch_std():
    """A_i = (r_i - mean_g) / (std_batch + eps), std over all six raw rewards:

    batch mean 7/12; deviations in twelfths 5, -7, -7, 5, 5, -1; squares sum 174/144;
    variance = 174/144 / 5 = 29/120.
    """
    std = math.sqrt(29 / 120)
    expected = CENTRED / (std + EPS)
    assert_close(group_advantages(REWARDS, GROUP_IDS, scale="batch", eps=EPS), expected)
    assert_close(REWARDS.std(), torch.tensor(std))


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_groups_of_one_get_zero(scale):
    """Every trajectory alone in its group: nothing to compare with, all advantages 0."""
    advantages = group_advantages(torch.tensor([3.0, -1.0, 2.0]), torch.arange(3), scale=scale)
    assert_close(advantages, torch.zeros(3))


@pytest.mark.parametrize("scale", ["group", "batch"])
def test_equal_rewards_give_zero_not_nan(scale):
    """A group whose rewards are all equal has std 0; eps keeps its advantage at 0."""
    advantages = group_advantages(torch.ones(4), torch.zeros(4, dtype=torch.long), scale=scale)
    assert_close(advantages, torch.zeros(4))


def test_integer_rewards_become_float():
    advantages = group_advantages(torch.tensor([1, 0]), torch.tensor([0, 0]), scale="none")
    assert_close(advantages, torch.tensor([0.5, -0.5]))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"scale": "global"}, "scale"),
        ({"eps": 0.0}, "eps"),
        ({"group_ids": torch.zeros(5, dtype=torch.long)}, "shape"),
    ],
)
def test_bad_advantage_arguments_raise(kwargs, match):
    args = {"rewards": REWARDS, "group_ids": GROUP_IDS, **kwargs}
    with pytest.raises(ValueError, match=match):
        group_advantages(**args)


# ---------------------------------------------------- off-policy corrections
def test_truncated_is_loss_values_and_gradient():
    """l = -min(r, cap) A, cap = 2, r = exp(logp - mu):

    r=0.5, A=+1: -0.5, gradient dl/dlogp = -A r = -0.5
    r=3.0, A=+1: -2.0 (capped), gradient 0
    r=1.5, A=-2:  3.0, gradient -A r = 3.0
    r=4.0, A=-1:  2.0 (capped), gradient 0: a stale token is never trusted beyond the cap
    """
    mu = torch.full((4,), -1.0)
    logp = (mu + torch.tensor([0.5, 3.0, 1.5, 4.0]).log()).requires_grad_()
    advantages = torch.tensor([1.0, 1.0, -2.0, -1.0])
    loss, stats = truncated_is_loss(logp, mu, advantages, cap=2.0)
    assert_close(loss, torch.tensor([-0.5, -2.0, 3.0, 2.0]))
    assert stats["clipped_high"].tolist() == [False, True, False, True]
    loss.sum().backward()
    assert_close(logp.grad, torch.tensor([-0.5, 0.0, 3.0, 0.0]))


def test_is_weight_scales_each_token_and_ignores_masked_ones():
    """dapo weights 1/3 over 3 active tokens, on-policy (r = 1): l_t = -A_t c_t.

    c = [2, 0.5, 1, inf(masked)], A = [1, 1, -1, 5] -> L = -(2 + 0.5 - 1) / 3 = -0.5.
    The masked token's infinite weight must not turn the loss into NaN.
    """
    logp = torch.zeros(4)
    ctx = LossContext(num_sequences=1, num_active_tokens=3)
    loss, _ = policy_loss(
        logp,
        logp,
        torch.tensor([1.0, 1.0, -1.0, 5.0]),
        torch.tensor([1.0, 1.0, 1.0, 0.0]),
        torch.zeros(4, dtype=torch.long),
        ctx,
        is_weight=torch.tensor([2.0, 0.5, 1.0, math.inf]),
    )
    assert_close(loss, torch.tensor(-0.5))


def test_decoupled_uses_the_proximal_policy_and_caps_its_weight():
    """pi_prox logprobs [-1, -0.5, -4] against mu [-1, -2, -3]: weights exp(prox - mu) =
    [1, e^1.5 = 4.48, e^-1 = 0.37], the middle one capped at 3; the clip centres on pi_prox."""
    mu = torch.tensor([-1.0, -2.0, -3.0])
    prox = torch.tensor([-1.0, -0.5, -4.0])
    extra = correction_inputs("decoupled", mu, lambda: prox, cap=3.0)
    assert_close(extra["old_logp"], prox)
    assert_close(extra["is_weight"], torch.tensor([1.0, 3.0, math.exp(-1.0)]))


def test_tis_and_none_need_no_proximal_forward():
    mu = torch.tensor([-1.0, -2.0, -3.0])

    def forbidden():
        raise AssertionError("no extra forward expected")

    assert correction_inputs("tis", mu, forbidden, cap=2.0)["tis_cap"] == 2.0
    none = correction_inputs("none", mu, forbidden, cap=2.0)
    assert set(none) == {"old_logp"} and none["old_logp"] is mu
    with pytest.raises(ValueError, match="must be one of"):
        correction_inputs("vtrace", mu, forbidden, cap=2.0)
