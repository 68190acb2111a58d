"""The memory probe: exact saved-activation bytes, and a peak that sees a large allocation."""

from __future__ import annotations

import torch
from torch import nn

from leantrain.memory import measure_step


def test_saved_bytes_count_activations_not_parameters() -> None:
    layer = nn.Linear(64, 64, bias=False)
    x = torch.randn(100, 64, requires_grad=True)

    def step() -> None:
        h = layer(x)  # saves x (input of the weight gradient); the weight is a parameter
        h.relu().sum().backward()  # relu saves its output: 100 x 64 floats

    mem = measure_step(layer, step)
    assert mem.saved_activation_bytes == 2 * 100 * 64 * 4


def test_peak_sees_a_temporary_allocation() -> None:
    layer = nn.Linear(4, 4)
    size = 64 * 2**20

    def step() -> None:
        big = torch.ones(size // 4)  # 64 MiB, touched, freed at the end of the step
        assert float(big[-1]) == 1.0

    mem = measure_step(layer, step)
    assert mem.source in ("rss", "rss-lifetime")
    assert mem.peak_bytes >= 0.9 * size
