"""Safety's fine-tuning: its cosine schedule is transformers' one, rate for rate, since the cached
memorised models were built with that."""

from __future__ import annotations

import pytest
import torch
from transformers import get_cosine_schedule_with_warmup

from leantrain.safety.training import cosine_to_zero


@pytest.mark.parametrize("steps", [1, 7, 20, 41, 600])
def test_cosine_to_zero_is_transformers_schedule_exactly(steps: int) -> None:
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=5e-3)
    schedule = get_cosine_schedule_with_warmup(optimizer, max(1, steps // 20), steps)
    rate = cosine_to_zero(5e-3, steps)
    for step in range(steps):
        assert rate(step) == optimizer.param_groups[0]["lr"], step
        optimizer.step()
        schedule.step()
    assert rate(0) == 0.0  # the warm-up starts from nothing
