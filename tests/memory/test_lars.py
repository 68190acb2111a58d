"""LARS: exact forward and input gradients, weight gradients that converge to the exact ones as
the rank grows (equal at full rank), less saved memory than LoRA, and drop-in replacement."""

from __future__ import annotations

import itertools

import pytest
import torch
from peft import LoraConfig, inject_adapter_in_model
from torch import nn

from leantrain.errors import LeantrainError
from leantrain.memory import LarsLinear, apply_lars, measure_step, principal_basis
from leantrain.models.finetune import backward_token_mean

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _activations(n: int = 200, d: int = 32) -> torch.Tensor:
    """Rows with a decaying spectrum, like real hidden states: singular values 1, 0.8, 0.64..."""
    g = torch.Generator().manual_seed(0)
    basis = torch.linalg.qr(torch.randn(d, d, generator=g)).Q
    return torch.randn(n, d, generator=g) * 0.8 ** torch.arange(d) @ basis.T


def _grads(layer: nn.Linear, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    x = x.clone().requires_grad_(True)
    layer.zero_grad()
    layer(x).tanh().sum().backward()  # a nonlinear loss: dy depends on the output
    return layer.weight.grad.clone(), layer.bias.grad.clone(), x.grad.clone()


def test_weight_gradient_converges_with_rank_and_is_exact_at_full_rank() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(32, 16)
    x = _activations()
    exact_w, exact_b, exact_x = _grads(linear, x)
    errors = []
    for rank in (1, 2, 4, 8, 16, 24, 32):
        grad_w, grad_b, grad_x = _grads(LarsLinear.from_linear(linear, rank), x)
        errors.append(float((grad_w - exact_w).norm() / exact_w.norm()))
        # bias and input gradients never need the saved activation: exact at every rank
        torch.testing.assert_close(grad_b, exact_b)
        torch.testing.assert_close(grad_x, exact_x)
    assert all(a > b for a, b in itertools.pairwise(errors)), errors
    assert errors[0] > 0.1  # rank 1 really is an approximation
    assert errors[-1] == 0.0  # full rank stores x itself


def test_principal_basis_is_orthonormal_and_captures_the_top_directions() -> None:
    x = _activations()
    for rank in (3, 8, 20):  # randomized path (2·rank < 32) and exact path
        q = principal_basis(x, rank)
        torch.testing.assert_close(q.T @ q, torch.eye(rank), atol=1e-5, rtol=0)
        captured = (x @ q).norm() ** 2 / x.norm() ** 2
        best = (torch.linalg.svdvals(x)[:rank] ** 2).sum() / x.norm() ** 2
        assert captured >= best * 0.999, (rank, captured, best)


def _model_grads(model: nn.Module, rank: int | None) -> dict[str, torch.Tensor]:
    if rank is not None:
        apply_lars(model, rank, PROJECTIONS)
    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(1))
    backward_token_mean(model, [(ids, ids)])
    return {n: p.grad for n, p in model.named_parameters() if n.endswith("proj.weight")}


def test_whole_model_gradients_approach_exact_ones(tiny_decoder) -> None:
    exact = _model_grads(tiny_decoder(), None)
    errors = {}
    for rank in (2, 8, 64):  # 64 >= every projection's input width (32 and 64): full rank
        grads = _model_grads(tiny_decoder(), rank)
        num = sum(float((grads[n] - exact[n]).norm() ** 2) for n in exact)
        errors[rank] = (num / sum(float(g.norm() ** 2) for g in exact.values())) ** 0.5
    assert errors[2] > errors[8] > errors[64], errors
    assert errors[64] < 1e-6, errors


def test_apply_lars_is_drop_in(tiny_decoder) -> None:
    model = tiny_decoder()
    before = {n: p for n, p in model.named_parameters()}
    replaced = apply_lars(model, 4, ["q_proj", "down_proj"])
    assert replaced == [
        f"model.layers.{i}.{m}" for i in range(2) for m in ("self_attn.q_proj", "mlp.down_proj")
    ]
    after = dict(model.named_parameters())
    assert after.keys() == before.keys()  # same state-dict names
    assert all(after[n] is before[n] for n in before)  # same tensors: optimizers see them
    with pytest.raises(LeantrainError, match="no trainable linear layer"):
        apply_lars(tiny_decoder(), 4, ["nonexistent_proj"])


def test_lora_plus_lars_wraps_only_the_adapter_inputs(tiny_decoder) -> None:
    model = tiny_decoder()
    model.requires_grad_(False)
    inject_adapter_in_model(LoraConfig(r=4, target_modules=list(PROJECTIONS)), model)
    replaced = apply_lars(model, 4, PROJECTIONS)
    assert replaced and all(name.endswith("lora_A.default") for name in replaced)
    assert len(replaced) == 2 * len(PROJECTIONS)


def _saved_bytes(model: nn.Module, method: str, length: int) -> int:
    model.requires_grad_(False)
    if method == "lora":
        inject_adapter_in_model(LoraConfig(r=4, target_modules=list(PROJECTIONS)), model)
    else:  # lars: full weights of the projections, activations at rank 4
        for name, p in model.named_parameters():
            p.requires_grad_(name.endswith("proj.weight"))
        apply_lars(model, 4, PROJECTIONS)
    ids = torch.randint(0, 64, (1, length), generator=torch.Generator().manual_seed(0))
    return measure_step(
        model, lambda: backward_token_mean(model, [(ids, ids)])
    ).saved_activation_bytes


def test_lars_saves_less_per_token_than_lora(tiny_decoder) -> None:
    lora = [_saved_bytes(tiny_decoder(), "lora", n) for n in (64, 256)]
    lars = [_saved_bytes(tiny_decoder(), "lars", n) for n in (64, 256)]
    assert lars[1] < lora[1]
    # bytes per extra token: the projection inputs shrink from their width to rank 4
    assert (lars[1] - lars[0]) < 0.85 * (lora[1] - lora[0]), (lars, lora)
