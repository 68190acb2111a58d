"""Off-policy corrections for stale samples, checked against hand-derived values."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from leantrain.rl.losses import LossContext, policy_loss, truncated_is_loss
from leantrain.rl.off_policy import correction_inputs
from leantrain.rl.packing import pack
from leantrain.rl.trajectory import Trajectory


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


def _batch():
    traj = Trajectory(
        prompt_ids=[1, 2],
        response_ids=[3, 4, 5],
        logprobs=[-1.0, -2.0, -3.0],
        versions=[0, 0, 0],
        loss_mask=[1, 1, 1],
        finish_reason="eos",
    )
    return pack([traj], torch.tensor([1.0]))


def test_decoupled_uses_the_proximal_policy_and_caps_its_weight():
    """pi_prox logprobs [-1, -0.5, -4] against mu [-1, -2, -3]: weights exp(prox - mu) =
    [1, e^1.5 = 4.48, e^-1 = 0.37], the middle one capped at 3; the clip centres on pi_prox."""
    mb = _batch()
    prox = torch.tensor([-1.0, -0.5, -4.0])
    extra = correction_inputs("decoupled", mb, lambda _: prox, cap=3.0)
    assert_close(extra["old_logp"], prox)
    assert_close(extra["is_weight"], torch.tensor([1.0, 3.0, math.exp(-1.0)]))


def test_tis_and_none_need_no_proximal_forward():
    mb = _batch()

    def forbidden(_):
        raise AssertionError("no extra forward expected")

    assert correction_inputs("tis", mb, forbidden, cap=2.0)["tis_cap"] == 2.0
    none = correction_inputs("none", mb, forbidden, cap=2.0)
    assert set(none) == {"old_logp"} and none["old_logp"] is mb.old_logprobs
    with pytest.raises(ValueError, match="must be one of"):
        correction_inputs("vtrace", mb, forbidden, cap=2.0)
