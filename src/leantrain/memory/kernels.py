"""Lean kernels: the gated MLP's activation product and RMSNorm, with exact gradients but fewer
tensors kept for backward than the stock PyTorch ops keep.

What stock autograd keeps, per token, in a Llama/Qwen-style decoder layer (hidden size d, MLP
width 4·d; read off `leantrain.memory.probe.saved_tensors`):

- `down(act(gate) * up)`: SiLU keeps its input `gate` (4·d), the product keeps both operands
  `act(gate)` and `up` (8·d), and down_proj's weight gradient keeps the product itself (4·d).
  `silu_mul` keeps only `gate` and `up` and recomputes `act(gate)` in backward (as Liger-Kernel's
  SiLUMul does): 4·d fewer, exact. When LARS compresses down_proj's input, the product is kept by
  nobody, so 8·d remain of stock's 16·d.
- RMSNorm `w * (x * rsqrt(mean(x²) + eps))`: stock keeps the float32 upcast of `x` (twice the
  bytes of a bf16 `x`) and, when `w` trains, the normalized tensor too. `rms_norm` keeps `x` in
  its own dtype and the per-token rstd (one float per token). For a float32 model with frozen norm
  weights (LoRA, LARS) this is what stock keeps already; it helps bf16 models and full fine-tuning.

`apply_lean_kernels` swaps these modules in place on HF Llama/Qwen/Mistral-style models; the
swapped modules hold the same parameter and child-module objects, so parameter names, state
dicts and optimizers are unchanged. Unknown architectures keep their stock modules, with a
warning. Knows nothing about LARS, LoRA or training loops.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn

# MLPs computing down_proj(act_fn(gate_proj(x)) * up_proj(x)) with act_fn = SiLU, and RMSNorms
# computing weight * (x.float() * rsqrt(mean(x²) + eps)).to(x.dtype): checked against the
# transformers sources of each class. Gemma's (1 + weight) norm and GELU MLP are not among them.
GATED_SILU_MLPS = ("LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP")
RMS_NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")


class _SiluMul(torch.autograd.Function):
    """silu(gate) * up, keeping gate and up only."""

    @staticmethod
    def forward(ctx, gate, up):  # type: ignore[override]
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        gate, up = ctx.saved_tensors
        # Math in float32 for half-precision inputs, as the stock kernels' internal math is.
        g, u, dout = gate.float(), up.float(), grad_out.float()
        # For float32 inputs, two gate-sized buffers in all, each becoming one of the returned
        # gradients (stock autograd holds three: the product's two operand gradients and SiLU's).
        sig = torch.sigmoid(g)
        # d silu(g)/dg = sig·(1 + g·(1 − sig))
        grad_gate = (1 - sig).mul_(g).add_(1).mul_(sig).mul_(u).mul_(dout)
        grad_up = sig.mul_(g).mul_(dout)  # silu(g)·dout, in sig's buffer
        return grad_gate.to(gate.dtype), grad_up.to(up.dtype)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up with exact gradients, keeping only `gate` and `up` for backward."""
    if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
        return _SiluMul.apply(gate, up)
    return F.silu(gate) * up


class _RMSNorm(torch.autograd.Function):
    """weight * (x * rstd), rstd = rsqrt(mean(x²) + eps) in float32; keeps x and rstd only."""

    @staticmethod
    def forward(ctx, x, weight, eps):  # type: ignore[override]
        x32 = x.float()
        rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)  # (..., 1)
        ctx.save_for_backward(x, weight, rstd)
        return weight * (x32 * rstd).to(x.dtype)

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        x, weight, rstd = ctx.saved_tensors
        normed = x.float() * rstd  # (..., d), recomputed: y = x·rstd
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            g = (grad_out * weight).float()  # gradient w.r.t. the normalized tensor
            # d(x·rstd)/dx applied to g: rstd·(g − y·mean(g·y))
            grad_x = (g - normed * (g * normed).mean(-1, keepdim=True)).mul_(rstd).to(x.dtype)
        if ctx.needs_input_grad[1]:
            prod = grad_out * normed.to(x.dtype)
            grad_w = prod.reshape(-1, prod.shape[-1]).sum(0).to(weight.dtype)
        return grad_x, grad_w, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF-style RMSNorm with exact gradients, keeping only `x` and the per-token rstd."""
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _RMSNorm.apply(x, weight, eps)
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class LeanGatedMLP(nn.Module):
    """down_proj(silu(gate_proj(x)) * up_proj(x)) through `silu_mul`; holds the replaced MLP's
    own projection modules (plain, LoRA-wrapped or LARS), so names and parameters are kept."""

    def __init__(self, gate_proj: nn.Module, up_proj: nn.Module, down_proj: nn.Module) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = gate_proj, up_proj, down_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_mul(self.gate_proj(x), self.up_proj(x)))


class LeanRMSNorm(nn.Module):
    """RMSNorm through `rms_norm`, sharing the replaced norm's `weight`."""

    def __init__(self, weight: nn.Parameter, eps: float) -> None:
        super().__init__()
        self.weight, self.variance_epsilon = weight, eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.variance_epsilon)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


def _lean_version(module: nn.Module) -> nn.Module | None:
    kind = type(module).__name__
    if kind in GATED_SILU_MLPS and type(module.act_fn).__name__ in ("SiLUActivation", "SiLU"):
        return LeanGatedMLP(module.gate_proj, module.up_proj, module.down_proj)
    if kind in RMS_NORMS:
        return LeanRMSNorm(module.weight, module.variance_epsilon)
    return None


def apply_lean_kernels(model: nn.Module) -> list[str]:
    """Replace, in place, every known gated-SiLU MLP by a `LeanGatedMLP` and every known RMSNorm
    by a `LeanRMSNorm`; returns the replaced module names.

    Decoder layers whose MLP class is not in `GATED_SILU_MLPS` (or whose activation is not SiLU)
    keep their stock modules, and a warning names the classes left alone: the result is then
    correct, only less lean.
    """
    replaced, unknown = [], set()
    for name, module in list(model.named_modules()):
        if isinstance(module, LeanGatedMLP | LeanRMSNorm):
            continue
        lean = _lean_version(module)
        if lean is None:
            if name.endswith(".mlp") or name.endswith("norm"):
                unknown.add(type(module).__name__)
            continue
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child, lean)
        replaced.append(name)
    if unknown:
        warnings.warn(
            f"lean kernels: kept the stock modules of {sorted(unknown)} (not a known gated-SiLU "
            f"MLP or RMSNorm: {GATED_SILU_MLPS + RMS_NORMS}); gradients are exact either way, "
            "memory is higher",
            stacklevel=2,
        )
    return replaced
