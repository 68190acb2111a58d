"""Lean kernels: gradients equal to the stock modules' (within 1e-6), fewer saved tensors, and a
module swap that keeps parameters and names, warns on unknown architectures, and makes LARS keep
under 0.62x of LoRA's saved bytes per token."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from peft import LoraConfig, inject_adapter_in_model
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
)
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from leantrain.memory import LeanGatedMLP, LeanRMSNorm, apply_lars, apply_lean_kernels
from leantrain.memory.kernels import rms_norm, silu_mul
from leantrain.memory.probe import saved_tensors
from leantrain.models.finetune import backward_token_mean

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _inputs(*shapes: tuple[int, ...], dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [(2 * torch.randn(s, generator=g)).to(dtype).requires_grad_(True) for s in shapes]


def _grads(fn, *tensors: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    for t in tensors:
        t.grad = None
    out = fn(*tensors)
    out.tanh().square().sum().backward()  # a nonlinear loss: the output gradient varies
    return out.detach(), [t.grad.clone() for t in tensors]


def test_silu_mul_matches_stock_and_keeps_two_tensors() -> None:
    gate, up = _inputs((3, 50, 64), (3, 50, 64))
    stock_out, stock_grads = _grads(lambda g, u: F.silu(g) * u, gate, up)
    lean_out, lean_grads = _grads(silu_mul, gate, up)
    torch.testing.assert_close(lean_out, stock_out, rtol=0, atol=0)
    for lean, stock in zip(lean_grads, stock_grads, strict=True):
        torch.testing.assert_close(lean, stock, rtol=0, atol=1e-6)
    # stock keeps gate (SiLU input), silu(gate) and up; the lean kernel keeps gate and up
    stock_saved = saved_tensors(torch.nn.Module(), lambda: F.silu(gate * 1) * (up * 1))
    lean_saved = saved_tensors(torch.nn.Module(), lambda: silu_mul(gate * 1, up * 1))
    assert [len(stock_saved), len(lean_saved)] == [3, 2]


@pytest.mark.parametrize("weight_trains", [False, True])
def test_rms_norm_matches_llama_rmsnorm(weight_trains: bool) -> None:
    (x,) = _inputs((2, 40, 48))
    stock = LlamaRMSNorm(48, eps=1e-6)
    with torch.no_grad():
        stock.weight.normal_(1.0, 0.3)
    stock.weight.requires_grad_(weight_trains)
    lean = LeanRMSNorm(stock.weight, stock.variance_epsilon)
    stock_out, (stock_grad,) = _grads(stock, x)
    stock_w = stock.weight.grad
    stock.weight.grad = None
    lean_out, (lean_grad,) = _grads(lean, x)
    torch.testing.assert_close(lean_out, stock_out, rtol=0, atol=0)
    torch.testing.assert_close(lean_grad, stock_grad, rtol=0, atol=1e-6)
    if weight_trains:
        torch.testing.assert_close(lean.weight.grad, stock_w, rtol=0, atol=1e-6)


def test_rms_norm_keeps_bf16_input_not_a_float32_copy() -> None:
    (x,) = _inputs((1, 64, 32), dtype=torch.bfloat16)
    stock = LlamaRMSNorm(32).to(torch.bfloat16)  # its weight trains

    def saved_bytes(fn) -> int:
        return sum(t.nbytes for t in saved_tensors(stock, lambda: fn(x * 1)))

    lean_bytes = saved_bytes(lambda t: rms_norm(t, stock.weight, 1e-6))
    # stock: float32 copy of x (4 bytes/number) and the bf16 normalized tensor (2) for the
    # weight gradient; lean: x in bf16 (2) and one float32 rstd per token
    assert saved_bytes(stock) == 64 * 32 * (4 + 2) + 64 * 4
    assert lean_bytes == 64 * 32 * 2 + 64 * 4


def _ids(length: int = 24) -> torch.Tensor:
    return torch.randint(0, 64, (2, length), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_swapped_model_has_stock_outputs_gradients_and_names(tiny_decoder, family: str) -> None:
    stock, lean = (tiny_decoder(family, intermediate=64, kv_heads=2) for _ in range(2))
    replaced = apply_lean_kernels(lean)
    layers = lean.config.num_hidden_layers
    assert len(replaced) == 3 * layers + 1  # mlp and two norms per layer, the final norm
    assert isinstance(lean.model.layers[0].mlp, LeanGatedMLP)
    assert isinstance(lean.model.norm, LeanRMSNorm)
    assert dict(lean.named_parameters()).keys() == dict(stock.named_parameters()).keys()
    ids = _ids()
    torch.testing.assert_close(lean(ids).logits, stock(ids).logits, rtol=0, atol=1e-6)
    for model in (stock, lean):  # full fine-tuning: every weight, norms included, has a gradient
        backward_token_mean(model, [(ids, ids)])
    lean_params = dict(lean.named_parameters())
    for name, p in stock.named_parameters():
        torch.testing.assert_close(lean_params[name].grad, p.grad, rtol=0, atol=1e-6)


def test_unknown_architecture_keeps_stock_modules_with_a_warning() -> None:
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32))
    before = [type(m) for m in model.modules()]
    with pytest.warns(UserWarning, match="kept the stock modules of .*GPT2MLP"):
        assert apply_lean_kernels(model) == []
    assert [type(m) for m in model.modules()] == before


def _saved_bytes(model: torch.nn.Module, method: str, length: int) -> int:
    """Bytes autograd saves for one step of `model` set up for `method`."""
    model.requires_grad_(False)
    if method.startswith("lora"):
        inject_adapter_in_model(LoraConfig(r=4, target_modules=list(PROJECTIONS)), model)
    else:  # lars: full weights of the projections, activations at rank 4
        for name, p in model.named_parameters():
            p.requires_grad_(name.endswith("proj.weight"))
        apply_lars(model, 4, PROJECTIONS)
    if method != "lora":
        apply_lean_kernels(model)
    ids = _ids(length)[:1]
    return sum(
        t.nbytes for t in saved_tensors(model, lambda: backward_token_mean(model, [(ids, ids)]))
    )


def test_lean_lars_keeps_under_0_62_of_lora_per_token(tiny_decoder) -> None:
    per_token = {}
    for method in ("lora", "lora+lean", "lars"):
        # MLP width 4·d, as in real models
        short, long = (_saved_bytes(tiny_decoder(intermediate=128), method, n) for n in (32, 160))
        per_token[method] = (long - short) / 128
    # Per layer and token, in d: LoRA keeps ~24.5 (norm inputs 2, projection inputs 6.4,
    # attention 4, SwiGLU 12); the lean kernels drop SiLU's output (4); LARS with them keeps
    # norm inputs, attention, gate and up and its rank-4 coordinates: ~14.6.
    assert per_token["lora+lean"] < 0.86 * per_token["lora"], per_token
    assert per_token["lars"] < 0.62 * per_token["lora"], per_token
