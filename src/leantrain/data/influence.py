"""TracIn influence (Pruthi et al., 2020) over saved checkpoints, with per-example gradients from
`torch.func` on all or a chosen subset of parameters, optionally randomly projected.

    TracIn(z, z') = sum over checkpoints c of  w_c * <grad l(theta_c, z), grad l(theta_c, z')>

with w_c the learning rate times the optimizer steps checkpoint c stands for. A training
sample's value is its mean TracIn over the validation set, which is one dot product with the
mean validation gradient per checkpoint: positive means the steps it took lowered validation
loss. Self-influence, TracIn(z, z), is large for samples the model finds hard to fit, such as
mislabelled ones.

Projection (LoGra-style, Choe et al., 2024): a weight matrix's gradient G (out x in) becomes
P_out G P_in^T (k x k) with Gaussian P of variance 1/k, so inner products are kept in
expectation (E[P^T P] = I) while a sample's gradient takes k^2 numbers per matrix instead of
out x in; vectors get a dense (k^2 x d) projection. Gradients are materialised per chunk of
samples, so memory is bounded by `chunk`, not by the dataset.

Knows nothing about what the model or loss is: `example_loss(forward, *example)` computes one
sample's scalar loss, calling `forward(...)` in place of `model(...)`.
"""

from __future__ import annotations

import contextlib
import re
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch.func import functional_call, grad, vmap

from leantrain.errors import LeantrainError

ExampleLoss = Callable[..., torch.Tensor]  # (forward, *example tensors without batch dim) -> ()


@dataclass(frozen=True)
class Checkpoint:
    """The chosen parameters at one point of training, and the weight w_c of its term."""

    params: dict[str, torch.Tensor]
    weight: float


@contextlib.contextmanager
def quiet_vmap() -> Iterator[None]:
    """Silence vmap's "performance drop" note: CPU attention (SDPA) has no batching rule, so vmap
    loops over the batch there, correctly, just without batching that one op."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="There is a performance drop")
        yield


def select_parameters(model: torch.nn.Module, pattern: str = "all") -> list[str]:
    """Names of the parameters to take gradients in: `all`, `last` (the last decoder layer and
    the final norm of an HF causal LM), or a regular expression searched in each name (e.g.
    `lora_` for LoRA adapters)."""
    names = [n for n, p in model.named_parameters()]
    if pattern == "all":
        chosen = names
    elif pattern == "last":
        layers = (
            getattr(model.get_decoder(), "layers", None) if hasattr(model, "get_decoder") else None
        )
        if not layers:
            raise LeantrainError("params 'last' needs an HF causal LM with decoder layers")
        last = len(layers) - 1
        chosen = [n for n in names if re.search(rf"layers\.{last}\.|(^|\.)norm\.weight$", n)]
    else:
        try:
            regex = re.compile(pattern)
        except re.error as exc:
            raise LeantrainError(
                f"params: {pattern!r} is not a regular expression: {exc}"
            ) from None
        chosen = [n for n in names if regex.search(n)]
    if not chosen:
        raise LeantrainError(f"params: {pattern!r} matches no parameter of {type(model).__name__}")
    return chosen


class GradientProjector:
    """Random projection of per-example gradients, one factor pair per parameter (see module
    docstring); `k=None` keeps gradients as they are (flattened), and so does a parameter with
    no more than k^2 numbers (projecting it would not save memory, only add noise)."""

    def __init__(self, shapes: dict[str, torch.Size], k: int | None, seed: int = 0) -> None:
        self.factors: dict[str, tuple[torch.Tensor, ...]] = {}
        if k is None:
            return
        if k < 1:
            raise LeantrainError(f"projection dimension must be >= 1, got {k}")
        gen = torch.Generator().manual_seed(seed)
        for name, shape in shapes.items():
            if int(np.prod(shape)) <= k * k:
                continue
            if len(shape) == 2:
                self.factors[name] = (
                    self._gaussian(k, shape[0], gen),
                    self._gaussian(k, shape[1], gen),
                )
            else:
                self.factors[name] = (self._gaussian(k * k, int(np.prod(shape)), gen),)

    @staticmethod
    def _gaussian(rows: int, cols: int, gen: torch.Generator) -> torch.Tensor:
        return torch.randn(rows, cols, generator=gen) / rows**0.5

    def __call__(self, grads: dict[str, torch.Tensor]) -> torch.Tensor:
        """Per-example gradients {name: (B, *shape)} -> (B, projected dimension)."""
        parts = []
        for name, g in grads.items():
            g = g.float()
            factors = [f.to(g.device) for f in self.factors.get(name, ())]
            if len(factors) == 2:  # (k, out) @ (B, out, in) @ (in, k)
                parts.append((factors[0] @ g @ factors[1].T).flatten(1))
            elif factors:
                parts.append(g.flatten(1) @ factors[0].T)
            else:
                parts.append(g.flatten(1))
        return torch.cat(parts, dim=1)


def per_example_gradients(
    model: torch.nn.Module,
    names: Sequence[str],
    example_loss: ExampleLoss,
    inputs: Sequence[torch.Tensor],
    projector: GradientProjector,
    chunk: int = 16,
) -> torch.Tensor:
    """(N, D) projected gradients of each sample's loss in the parameters `names`, from
    `vmap(grad(...))` over chunks of `chunk` samples (inputs are stacked, batch first)."""
    chosen = {n: p.detach() for n, p in model.named_parameters() if n in names}
    frozen = {n: p.detach() for n, p in model.named_parameters() if n not in chosen}
    frozen.update(dict(model.named_buffers()))

    def loss(params: dict[str, torch.Tensor], *example: torch.Tensor) -> torch.Tensor:
        def forward(*args: object, **kwargs: object) -> object:
            return functional_call(model, {**frozen, **params}, args, kwargs)

        return example_loss(forward, *example)

    per_example = vmap(grad(loss), in_dims=(None, *[0] * len(inputs)))
    n = len(inputs[0])
    with quiet_vmap():
        return torch.cat(
            [
                projector(per_example(chosen, *[x[s : s + chunk] for x in inputs]))
                for s in range(0, n, chunk)
            ]
        )


@dataclass(frozen=True)
class TracInScores:
    """Per training sample: mean TracIn on the validation set (its value) and self-influence."""

    value: np.ndarray
    self_influence: np.ndarray


def tracin(
    model: torch.nn.Module,
    checkpoints: Sequence[Checkpoint],
    example_loss: ExampleLoss,
    train_inputs: Sequence[torch.Tensor],
    valid_inputs: Sequence[torch.Tensor],
    projection: int | None = None,
    chunk: int = 16,
    seed: int = 0,
    on_checkpoint: Callable[[int], None] | None = None,
) -> TracInScores:
    """TracIn of every training sample over `checkpoints` (whose params are loaded in turn; the
    model's own weights are restored afterwards)."""
    if not checkpoints:
        raise LeantrainError("TracIn needs at least one checkpoint")
    names = list(checkpoints[0].params)
    params = dict(model.named_parameters())
    saved = {n: params[n].detach().clone() for n in names}
    projector = GradientProjector({n: params[n].shape for n in names}, projection, seed)
    value = self_influence = None
    try:
        for done, ckpt in enumerate(checkpoints, start=1):
            with torch.no_grad():
                for n in names:
                    params[n].copy_(ckpt.params[n])
            train = per_example_gradients(
                model, names, example_loss, train_inputs, projector, chunk
            )
            valid = per_example_gradients(
                model, names, example_loss, valid_inputs, projector, chunk
            )
            v = ckpt.weight * (train @ valid.mean(0))
            s = ckpt.weight * (train * train).sum(1)
            value = v if value is None else value + v
            self_influence = s if self_influence is None else self_influence + s
            if on_checkpoint is not None:
                on_checkpoint(done)
    finally:
        with torch.no_grad():
            for n in names:
                params[n].copy_(saved[n])
    return TracInScores(value.double().numpy(), self_influence.double().numpy())


def sgd_checkpoints(
    model: torch.nn.Module,
    names: Sequence[str],
    example_loss: ExampleLoss,
    inputs: Sequence[torch.Tensor],
    *,
    steps: int,
    lr: float,
    batch_size: int,
    checkpoint_every: int,
    seed: int = 0,
    on_step: Callable[[int], None] | None = None,
) -> list[Checkpoint]:
    """Train the parameters `names` with plain SGD on mini-batches of `inputs`, recording a
    checkpoint before steps 0, every, 2 * every, ... each weighted lr * every (the steps it
    stands for). Plain SGD makes that weight TracIn's exact step size; the other parameters stay
    frozen, and the model stays in eval mode (no dropout: the gradients TracIn takes later are
    the ones the steps followed). Training changes the model in place; checkpoints are copies."""
    if steps < 1 or checkpoint_every < 1 or batch_size < 1 or lr <= 0:
        raise LeantrainError(
            "sgd_checkpoints needs steps, checkpoint_every, batch_size >= 1, lr > 0"
        )
    params = dict(model.named_parameters())
    flags = {n: p.requires_grad for n, p in params.items()}
    for n, p in params.items():
        p.requires_grad_(n in names)
    optimizer = torch.optim.SGD([params[n] for n in names], lr=lr)
    batched_loss = vmap(lambda *ex: example_loss(model, *ex))
    gen = torch.Generator().manual_seed(seed)
    n_samples = len(inputs[0])
    checkpoints = []
    try:
        for step in range(steps):
            if step % checkpoint_every == 0:
                snapshot = {n: params[n].detach().clone() for n in names}
                checkpoints.append(Checkpoint(snapshot, lr * min(checkpoint_every, steps - step)))
            batch = torch.randint(0, n_samples, (batch_size,), generator=gen)
            optimizer.zero_grad()
            with quiet_vmap():
                batched_loss(*[x[batch] for x in inputs]).mean().backward()
            optimizer.step()
            if on_step is not None:
                on_step(step + 1)
    finally:
        for n, p in params.items():
            p.requires_grad_(flags[n])
    return checkpoints
