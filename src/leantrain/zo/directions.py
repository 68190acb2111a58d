"""Perturbation directions regenerated from seeds, and fused in-place moves along them.

A direction z(seed) is one standard-normal tensor per trainable tensor, drawn in parameter order
from one generator seeded with `seed`: the same numbers MeZO's reference code draws with
`torch.manual_seed(seed)` followed by one `torch.normal` per parameter, so a run here and a run of
the reference walk the same directions. Nothing but the seed is stored: z is regenerated (into a
reusable buffer) every time it is needed.

The arithmetic of a move also follows the reference, rounding for rounding: a perturbation is
`theta + (scale * z) * eps` and an update `theta - lr * (g * z)`, so both sides hold bit-identical
weights after every step. The difference is how: `torch._foreach_*` over chunks of tensors (one
kernel launch per chunk instead of three per tensor), in place, into a preallocated buffer, and
the last restore fused with the update so z is drawn once for both.

What it does NOT know about: models, losses, estimators (see `estimators.py` for which moves a
step makes).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from leantrain.errors import LeantrainError

Move = tuple[int, float]  # (seed, scale): theta <- theta + (scale * z(seed)) * eps


class SeedStream:
    """Direction seeds, drawn like MeZO's `np.random.randint(1000000000)` after seeding numpy
    with the run seed: a baseline and an engine built with the same seed get the same seeds."""

    def __init__(self, seed: int) -> None:
        self._rng = np.random.RandomState(seed)

    def next(self, count: int) -> list[int]:
        return [int(self._rng.randint(1_000_000_000)) for _ in range(count)]


class Directions:
    """Moves a fixed list of tensors along seeded normal directions, in place.

    Args:
        tensors: the trainable tensors, in the order their z is drawn (`named_parameters` order).
        chunk_numel: elements per fused chunk; bounds the z buffer (a tensor larger than this is
            a chunk of its own). Small keeps memory at inference level, large launches fewer ops.
        masks: optional boolean tensor per tensor: only True entries move (sparse ZO). z is still
            drawn for every entry, so masked and unmasked runs consume the same random stream.
    """

    def __init__(
        self,
        tensors: Sequence[torch.Tensor],
        chunk_numel: int = 1 << 18,
        masks: Sequence[torch.Tensor] | None = None,
    ) -> None:
        if not tensors:
            raise LeantrainError("ZO needs at least one trainable tensor; none requires grad")
        dtypes = {t.dtype for t in tensors}
        if len(dtypes) != 1:
            raise LeantrainError(f"ZO tensors must share one dtype, got {sorted(map(str, dtypes))}")
        if masks is not None and len(masks) != len(tensors):
            raise LeantrainError(f"{len(masks)} masks for {len(tensors)} tensors")
        self.tensors = list(tensors)
        self.masks = list(masks) if masks is not None else None
        self.device = tensors[0].device
        self.chunks: list[list[int]] = []  # indices of the tensors fused together
        size = 0
        for i, t in enumerate(tensors):
            if self.chunks and size + t.numel() <= chunk_numel:
                self.chunks[-1].append(i)
                size += t.numel()
            else:
                self.chunks.append([i])
                size = t.numel()
        largest = max(sum(tensors[i].numel() for i in c) for c in self.chunks)
        self._buffer = torch.empty(largest, dtype=tensors[0].dtype, device=self.device)

    def _draw(self, chunk: list[int], generator: torch.Generator) -> list[torch.Tensor]:
        """z for the tensors of `chunk`, as views into the buffer, continuing `generator`."""
        views, offset = [], 0
        for i in chunk:
            t = self.tensors[i]
            view = self._buffer[offset : offset + t.numel()].view_as(t)
            view.normal_(generator=generator)
            views.append(view)
            offset += t.numel()
        if self.masks is not None:
            torch._foreach_mul_(views, [self.masks[i] for i in chunk])
        return views

    def _generator(self, seed: int) -> torch.Generator:
        generator = torch.Generator(device=self.device)
        generator.manual_seed(seed)
        return generator

    def move_(self, seed: int, scale: float, eps: float) -> None:
        """theta <- theta + (scale * z(seed)) * eps."""
        generator = self._generator(seed)
        for chunk in self.chunks:
            z = self._draw(chunk, generator)
            torch._foreach_mul_(z, scale)
            torch._foreach_mul_(z, eps)
            torch._foreach_add_([self.tensors[i] for i in chunk], z)

    def move_and_update_(self, seed: int, scale: float, eps: float, g: float, lr: float) -> None:
        """`move_(seed, scale, eps)` then `update_(seed, g, lr)`, drawing z once for both."""
        generator = self._generator(seed)
        for chunk in self.chunks:
            z = self._draw(chunk, generator)
            tensors = [self.tensors[i] for i in chunk]
            step = torch._foreach_mul(z, scale)  # a temporary the size of one chunk
            torch._foreach_mul_(step, eps)
            torch._foreach_add_(tensors, step)
            self._descend(tensors, z, g, lr)

    def update_(self, seed: int, g: float, lr: float) -> None:
        """theta <- theta - lr * (g * z(seed)): one SGD step along z with projected gradient g."""
        generator = self._generator(seed)
        for chunk in self.chunks:
            self._descend([self.tensors[i] for i in chunk], self._draw(chunk, generator), g, lr)

    @staticmethod
    def _descend(tensors: list[torch.Tensor], z: list[torch.Tensor], g: float, lr: float) -> None:
        torch._foreach_mul_(z, g)
        torch._foreach_mul_(z, lr)
        torch._foreach_sub_(tensors, z)


def small_magnitude_masks(tensors: Sequence[torch.Tensor], fraction: float) -> list[torch.Tensor]:
    """Sparse MeZO: per tensor, True on the `fraction` of entries smallest in magnitude (those are
    the ones perturbed and updated; large weights stay put)."""
    if not 0.0 < fraction <= 1.0:
        raise LeantrainError(f"sparse fraction must be in (0, 1], got {fraction}")
    masks = []
    for t in tensors:
        k = max(1, round(fraction * t.numel()))
        threshold = t.detach().abs().flatten().kthvalue(k).values
        masks.append(t.detach().abs() <= threshold)
    return masks
