"""Seeded directions and fused moves: the same numbers and the same arithmetic as MeZO's
reference code (global seed, one torch.normal per tensor, out-of-place rebinding)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from leantrain.errors import LeantrainError
from leantrain.zo.directions import Directions, SeedStream, small_magnitude_masks

SHAPES = [(7, 5), (3,), (16, 4), (1, 9)]
EPS = 1e-3


def weights() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(123)
    return [torch.randn(s, generator=gen) for s in SHAPES]


def reference_move(tensors: list[torch.Tensor], seed: int, scale: float) -> list[torch.Tensor]:
    """MeZO's zo_perturb_parameters: reseed the global generator, z per tensor, rebind."""
    torch.manual_seed(seed)
    out = []
    for t in tensors:
        z = torch.normal(mean=0, std=1, size=t.size(), dtype=t.dtype)
        out.append(t + scale * z * EPS)
    return out


def reference_update(tensors: list[torch.Tensor], seed: int, g: float, lr: float):
    torch.manual_seed(seed)
    return [t - lr * (g * torch.normal(mean=0, std=1, size=t.size())) for t in tensors]


def assert_bit_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y), float((x - y).abs().max())


@pytest.mark.parametrize("hold_numel", [0, 1 << 20])  # z redrawn for every move, or held
@pytest.mark.parametrize("chunk_numel", [1, 40, 1 << 20])  # a chunk per tensor, some, all
def test_moves_match_the_reference_bit_for_bit(chunk_numel: int, hold_numel: int) -> None:
    mine, ref = weights(), weights()
    directions = Directions(mine, chunk_numel=chunk_numel, hold_numel=hold_numel)
    assert directions.holds == (hold_numel > 0)
    for seed, scale in [(11, 1.0), (11, -2.0), (11, 1.0), (99, 1.0), (99, -2.0)]:
        directions.move_(seed, scale, EPS)
        ref = reference_move(ref, seed, scale)
        assert_bit_equal(mine, ref)


@pytest.mark.parametrize("hold_numel", [0, 1 << 20])
def test_restore_fused_with_update_matches_the_reference(hold_numel: int) -> None:
    mine, ref = weights(), weights()
    directions = Directions(mine, chunk_numel=50, hold_numel=hold_numel)
    directions.move_(5, 1.0, EPS)
    directions.move_(5, -2.0, EPS)
    directions.move_and_update_(5, 1.0, EPS, g=0.37, lr=0.1)
    ref = reference_move(reference_move(ref, 5, 1.0), 5, -2.0)
    ref = reference_update(reference_move(ref, 5, 1.0), 5, g=0.37, lr=0.1)
    assert_bit_equal(mine, ref)


def test_perturb_then_restore_leaves_weights_equal() -> None:
    start, moved = weights(), weights()
    directions = Directions(moved)
    directions.move_(7, 1.0, EPS)
    assert all((a - b).abs().max() > EPS / 10 for a, b in zip(start, moved, strict=True))
    directions.move_(7, -2.0, EPS)
    directions.move_(7, 1.0, EPS)  # +eps z, -2 eps z, +eps z: back where it started
    for a, b in zip(start, moved, strict=True):
        # Rounding of theta + eps z - 2 eps z + eps z is at most a few ulps of theta.
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6)


def test_masks_move_only_the_small_weights_and_keep_the_stream() -> None:
    tensors = weights()
    masks = small_magnitude_masks(tensors, 0.25)
    for t, m in zip(tensors, masks, strict=True):
        assert m.sum() >= round(0.25 * t.numel())
        assert t[m].abs().max() <= t[~m].abs().min()
    sparse, dense = weights(), weights()
    Directions(sparse, masks=masks).move_(3, 1.0, EPS)
    Directions(dense).move_(3, 1.0, EPS)
    for s, d, t, m in zip(sparse, dense, weights(), masks, strict=True):
        assert torch.equal(s[~m], t[~m])  # large weights untouched
        assert torch.equal(s[m], d[m])  # small ones moved exactly as without a mask


def test_new_masks_drop_the_held_direction() -> None:
    tensors = weights()
    directions = Directions(tensors)
    directions.move_(3, 1.0, EPS)  # holds z(3), unmasked
    masks = small_magnitude_masks(tensors, 0.25)
    before = [t.clone() for t in tensors]
    directions.masks = masks
    directions.move_(3, 1.0, EPS)  # must move along the masked z(3)
    for t, b, m in zip(tensors, before, masks, strict=True):
        assert torch.equal(t[~m], b[~m])


def test_seed_stream_draws_what_mezo_draws() -> None:
    np.random.seed(42)
    expected = [int(np.random.randint(1_000_000_000)) for _ in range(5)]
    stream = SeedStream(42)
    assert stream.next(2) + stream.next(3) == expected


def test_bad_inputs_are_named() -> None:
    with pytest.raises(LeantrainError, match="at least one trainable"):
        Directions([])
    with pytest.raises(LeantrainError, match="one dtype"):
        Directions([torch.zeros(2), torch.zeros(2, dtype=torch.float64)])
    with pytest.raises(LeantrainError, match="sparse fraction"):
        small_magnitude_masks(weights(), 0.0)
