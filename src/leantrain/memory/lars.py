"""LARS (Low-memory Activation-Rank Subspace, arXiv 2604.22783): the low-rank constraint goes on
the activations saved for backward, not on the parameters.

A linear layer y = x Wᵀ + b needs its input x (n tokens × d) only to form the weight gradient
dW = dyᵀ x. LoRA and full fine-tuning keep all of x alive until backward, so that memory grows
with n at d numbers per token. A `LarsLinear` computes the forward exactly, then keeps only the
coordinates of x in its top-`rank` principal subspace: coefficients c = x Q (n × rank) and the
basis Q (d × rank), and forms dW = (dyᵀ c) Qᵀ in backward. Saved memory per token drops from d to
`rank` numbers, so the step's memory grows far more slowly with sequence length. The input
gradient dx = dy W needs no saved activation and stays exact.

The paper's text available to us gives the idea and the figures, not the algorithm, so these are
our choices:

- Subspace: the top-`rank` principal subspace of this call's activations (the best rank-r
  approximation of x, Eckart–Young), recomputed at every forward by randomized subspace
  iteration with a fixed-seed sketch (O(n·d·rank), deterministic); exact eigenvectors of xᵀx when
  2·rank >= d. As `rank` grows the weight gradient's error shrinks, and at `rank >= d` the layer
  stores x itself, so the gradient is exact.
- Sharing: projections that read the same input tensor (q/k/v, gate/up) share one saved copy of
  its coordinates, as they would share x itself.
- Scope: the linear layers fine-tuning trains. `method: lars` trains the full weights of the
  targeted projections (each step's update lies in the activation subspace); `lora+lars` wraps
  peft's LoRA `lora_A` layers (the ones that save the d-wide input); `lora_B`'s input already has
  LoRA's rank and is left alone.
- Layers whose weight is frozen save nothing for the weight gradient, so they are not replaced.

Knows nothing about training loops or models beyond `nn.Linear` and peft's `lora_A` layers.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from leantrain.errors import LeantrainError


def principal_basis(flat: torch.Tensor, rank: int, power_iters: int = 2) -> torch.Tensor:
    """Orthonormal basis (d, rank) of the top-`rank` principal subspace of the rows of `flat`
    (n, d), in float32 math.

    Randomized subspace iteration (Halko et al. 2011) with 2x oversampling and a fixed-seed
    sketch: O(n·d·rank) instead of the O(n·d² + d³) of an eigendecomposition of xᵀx, and
    deterministic. When the oversampled sketch would span all d dimensions, the exact
    eigenvectors of xᵀx are used instead. The basis is returned in its own (d, rank) storage,
    since it is saved for backward: a view would keep the whole factorization alive.
    """
    x = flat.float()
    d = x.shape[1]
    width = min(d, 2 * rank)
    if width >= d:
        _, vectors = torch.linalg.eigh(x.T @ x)  # ascending eigenvalues
        return vectors[:, -rank:].contiguous().to(flat.dtype)
    generator = torch.Generator(device=x.device).manual_seed(0)
    sketch = torch.randn(d, width, generator=generator, device=x.device)  # (d, k)
    rows = torch.linalg.qr(x @ sketch).Q  # (n, k): range of x
    for _ in range(power_iters):  # sharpen towards the top singular directions
        rows = torch.linalg.qr(x @ torch.linalg.qr(x.T @ rows).Q).Q
    _, _, vh = torch.linalg.svd(rows.T @ x, full_matrices=False)  # (k, d)
    return vh[:rank].T.contiguous().to(flat.dtype)


class _SubspaceCache:
    """The last input's coefficients and basis. The q/k/v (and gate/up) projections read the
    same input tensor one after another; they share one saved copy of its coordinates instead of
    three. Weak references only: an entry never keeps a tensor alive or outlives its input."""

    def __init__(self) -> None:
        self.entry: tuple[weakref.ref, int, int, weakref.ref, weakref.ref] | None = None

    def get(self, x: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self.entry is None:
            return None
        x_ref, version, cached_rank, coeffs_ref, basis_ref = self.entry
        if x_ref() is not x or version != x._version or cached_rank != rank:
            return None
        coeffs, basis = coeffs_ref(), basis_ref()
        return None if coeffs is None or basis is None else (coeffs, basis)

    def put(self, x: torch.Tensor, rank: int, coeffs: torch.Tensor, basis: torch.Tensor) -> None:
        self.entry = (weakref.ref(x), x._version, rank, weakref.ref(coeffs), weakref.ref(basis))


_cache = _SubspaceCache()


def compress(x: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(coefficients (n, rank), basis (d, rank)) of `x` (..., d) in its principal subspace,
    shared with the previous call if that was on the same, unmodified tensor and rank."""
    hit = _cache.get(x, rank)
    if hit is not None:
        return hit
    flat = x.detach().reshape(-1, x.shape[-1])
    basis = principal_basis(flat, rank)
    coeffs = flat @ basis
    _cache.put(x, rank, coeffs, basis)
    return coeffs, basis


class _LowRankSavedLinear(torch.autograd.Function):
    """y = x Wᵀ + b, saving x only as its rank-`rank` principal coordinates for dW."""

    @staticmethod
    def forward(ctx, x, weight, bias, rank):  # type: ignore[override]
        out = F.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))
        flat = x.detach().reshape(-1, x.shape[-1])  # (n, d_in)
        ctx.x_shape = x.shape
        if rank >= flat.shape[-1]:
            coeffs, basis = flat, None  # full rank: keep x itself, the gradient is exact
        else:
            coeffs, basis = compress(x, rank)  # (n, r), (d_in, r)
        ctx.save_for_backward(weight, coeffs, basis)
        ctx.has_bias = bias is not None
        return out

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        weight, coeffs, basis = ctx.saved_tensors
        flat_grad = grad_out.reshape(-1, grad_out.shape[-1])  # (n, d_out)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = (flat_grad @ weight.to(flat_grad.dtype)).reshape(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            grad_w = flat_grad.T.to(coeffs.dtype) @ coeffs  # (d_out, r) or (d_out, d_in)
            if basis is not None:
                grad_w = grad_w @ basis.T  # back to (d_out, d_in)
            grad_w = grad_w.to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = flat_grad.sum(0).to(weight.dtype)
        return grad_x, grad_w, grad_b, None


class LarsLinear(nn.Linear):
    """Drop-in `nn.Linear` whose backward uses the rank-`rank` activation subspace.

    It shares its `weight` and `bias` with the layer it replaces, so state dicts, optimizers and
    `save_pretrained` see the same parameter names and tensors.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, rank: int = 8):
        super().__init__(in_features, out_features, bias=bias)
        if rank < 1:
            raise ValueError(f"LARS rank must be >= 1, got {rank}")
        self.rank = rank

    @classmethod
    def from_linear(cls, linear: nn.Linear, rank: int) -> LarsLinear:
        """A LarsLinear sharing `linear`'s parameters (no copy)."""
        with torch.device("meta"):  # skip allocating weights that are replaced at once
            new = cls(linear.in_features, linear.out_features, linear.bias is not None, rank=rank)
        new.weight = linear.weight
        new.bias = linear.bias
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (torch.is_grad_enabled() and self.weight.requires_grad):
            return F.linear(x, self.weight, self.bias)  # nothing is saved: plain and fast
        return _LowRankSavedLinear.apply(x, self.weight, self.bias, self.rank)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.rank}"


def apply_lars(model: nn.Module, rank: int, targets: Iterable[str]) -> list[str]:
    """Replace, in place, every trainable `nn.Linear` whose name ends in one of `targets`
    (e.g. "q_proj") and every peft LoRA `lora_A` layer by a `LarsLinear` of `rank`.

    Returns the replaced module names. Raises a LeantrainError if nothing matched, since a silent
    no-op would make a "LARS" run plain full fine-tuning or LoRA.
    """
    targets = set(targets)
    chosen = []
    for name, module in model.named_modules():
        if type(module) is not nn.Linear or not module.weight.requires_grad:
            continue
        parts = name.split(".")
        in_lora_a = len(parts) >= 2 and parts[-2] == "lora_A"
        in_lora = any(p in ("lora_A", "lora_B", "base_layer") for p in parts)
        if in_lora_a or (parts[-1] in targets and not in_lora):
            chosen.append(name)
    if not chosen:
        raise LeantrainError(
            f"lars: found no trainable linear layer named {sorted(targets)} and no LoRA lora_A "
            "layer to replace"
        )
    for name in chosen:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child, LarsLinear.from_linear(getattr(parent, child), rank))
    return chosen
