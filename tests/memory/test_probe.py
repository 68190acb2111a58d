"""The memory probe: exact saved-activation bytes, each saved tensor with the module that saved it,
and a peak that sees a large allocation."""

from __future__ import annotations

import torch
from torch import nn

from leantrain.memory import measure_step, saved_tensors


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


def test_saved_tensors_names_the_module_that_saved_each() -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    x = torch.randn(10, 8, requires_grad=True)
    saved = saved_tensors(model, lambda: model(x).sum().backward())
    # first linear: its input x; ReLU: its output (10 x 16), which the second linear's weight
    # gradient reads too, so that storage is counted once, under the module that saved it first
    assert [(t.module, t.shape, t.nbytes) for t in saved] == [
        ("0", (10, 8), 10 * 8 * 4),
        ("1", (10, 16), 10 * 16 * 4),
    ]
    assert saved[1].producer == "ReluBackward0"
