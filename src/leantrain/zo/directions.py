"""Perturbation directions regenerated from seeds, and fused in-place moves along them.

A direction z(seed) is one standard-normal tensor per trainable tensor, drawn in parameter order
from one generator seeded with `seed`: the same numbers MeZO's reference code draws with
`torch.manual_seed(seed)` followed by one `torch.normal` per parameter, so a run here and a run of
the reference walk the same directions. Nothing but the seed is stored: z is regenerated (into a
reusable buffer) every time it is needed.

The arithmetic of a move also follows the reference, rounding for rounding: a perturbation is
`theta + (scale * z) * eps` and an update `theta - lr * (g * z)`, so both sides hold bit-identical
weights after every step. The difference is how: `torch._foreach_*` over chunks of tensors (one
kernel launch per chunk instead of three per tensor), in place, z drawn into a preallocated
buffer, and drawn once per seed and step where the buffer can hold all of it (LoRA factors, small
models), else once for the last restore and the update together.

What it does NOT know about: models, losses, estimators (see `estimators.py` for which moves a
step makes).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

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
        chunk_numel: elements per fused chunk; bounds the temporaries of a move (a tensor larger
            than this is a chunk of its own). Small keeps memory at inference level, large
            launches fewer ops.
        masks: optional boolean tensor per tensor: only True entries move (sparse ZO). z is still
            drawn for every entry, so masked and unmasked runs consume the same random stream.
        hold_numel: when all tensors together have at most this many elements, the z buffer
            holds the whole direction and keeps it: the moves of one seed (+1, -2, back and
            update) draw z once instead of each drawing it again. Larger tensors get a buffer
            of one chunk, redrawn for every move.
    """

    def __init__(
        self,
        tensors: Sequence[torch.Tensor],
        chunk_numel: int = 1 << 18,
        masks: Sequence[torch.Tensor] | None = None,
        hold_numel: int = 1 << 21,
    ) -> None:
        if not tensors:
            raise LeantrainError("ZO needs at least one trainable tensor; none requires grad")
        dtypes = {t.dtype for t in tensors}
        if len(dtypes) != 1:
            raise LeantrainError(f"ZO tensors must share one dtype, got {sorted(map(str, dtypes))}")
        self.tensors = list(tensors)
        self.masks = masks
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
        total = sum(t.numel() for t in tensors)
        self.holds = total <= hold_numel
        largest = max(sum(tensors[i].numel() for i in c) for c in self.chunks)
        self._buffer = torch.empty(
            total if self.holds else largest, dtype=tensors[0].dtype, device=self.device
        )
        # z's views per chunk: consecutive in a holding buffer, all at its start otherwise.
        self._views: list[list[torch.Tensor]] = []
        offset = 0
        for chunk in self.chunks:
            if not self.holds:  # a chunk-sized buffer: every chunk starts at 0
                offset = 0
            views = []
            for i in chunk:
                views.append(self._buffer[offset : offset + tensors[i].numel()].view_as(tensors[i]))
                offset += tensors[i].numel()
            self._views.append(views)

    @property
    def masks(self) -> list[torch.Tensor] | None:
        return self._masks

    @masks.setter
    def masks(self, masks: Sequence[torch.Tensor] | None) -> None:
        if masks is not None and len(masks) != len(self.tensors):
            raise LeantrainError(f"{len(masks)} masks for {len(self.tensors)} tensors")
        self._masks = list(masks) if masks is not None else None
        self._held: int | None = None  # the seed whose masked z the buffer holds

    def _z(self, seed: int) -> Iterator[tuple[list[torch.Tensor], list[torch.Tensor]]]:
        """(tensors, z(seed) views) per chunk, z drawn unless the buffer holds it already. Lazy:
        without holding, the chunks share the buffer, so a chunk's z lasts until the next one's."""
        if self._held == seed:
            for chunk, views in zip(self.chunks, self._views, strict=True):
                yield [self.tensors[i] for i in chunk], views
            return
        self._held = None
        generator = torch.Generator(device=self.device)
        generator.manual_seed(seed)
        for chunk, views in zip(self.chunks, self._views, strict=True):
            for view in views:
                view.normal_(generator=generator)
            if self._masks is not None:
                torch._foreach_mul_(views, [self._masks[i] for i in chunk])
            yield [self.tensors[i] for i in chunk], views
        if self.holds:
            self._held = seed

    def move_(self, seed: int, scale: float, eps: float) -> None:
        """theta <- theta + (scale * z(seed)) * eps."""
        for tensors, z in self._z(seed):
            step = torch._foreach_mul(z, scale)  # a temporary the size of one chunk
            torch._foreach_mul_(step, eps)
            torch._foreach_add_(tensors, step)

    def move_and_update_(self, seed: int, scale: float, eps: float, g: float, lr: float) -> None:
        """`move_(seed, scale, eps)` then `update_(seed, g, lr)`, drawing z at most once."""
        for tensors, z in self._z(seed):
            step = torch._foreach_mul(z, scale)
            torch._foreach_mul_(step, eps)
            torch._foreach_add_(tensors, step)
            self._descend(tensors, z, g, lr)

    def update_(self, seed: int, g: float, lr: float) -> None:
        """theta <- theta - lr * (g * z(seed)): one SGD step along z with projected gradient g."""
        for tensors, z in self._z(seed):
            self._descend(tensors, z, g, lr)

    @staticmethod
    def _descend(tensors: list[torch.Tensor], z: list[torch.Tensor], g: float, lr: float) -> None:
        step = torch._foreach_mul(z, g)  # z itself stays intact (it may be held)
        torch._foreach_mul_(step, lr)
        torch._foreach_sub_(tensors, step)


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
