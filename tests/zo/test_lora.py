"""Stacked adapters: S copies of the LoRA state scored in one forward."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from leantrain.errors import LeantrainError
from leantrain.models import load_model
from leantrain.zo.lora import add_lora, lora_factors, stacked_adapters


def test_each_row_group_runs_under_its_own_adapter(tiny_path: Path) -> None:
    model, _ = load_model(tiny_path)
    torch.manual_seed(0)
    model = add_lora(model, r=4, alpha=8, targets=["q_proj", "v_proj"])
    factors = lora_factors(model)
    assert [f.weight for f in factors] == [p for p in model.parameters() if p.requires_grad]
    ids = torch.randint(3, 259, (2, 10), generator=torch.Generator().manual_seed(1))
    states = [[torch.randn_like(f.weight) * 0.1 for f in factors] for _ in range(3)]
    with torch.inference_mode():
        expected = []
        for state in states:  # one forward per state, weights swapped in
            for f, w in zip(factors, state, strict=True):
                f.weight.copy_(w)
            expected.append(model(input_ids=ids).logits)
        stacks = [torch.stack([s[i] for s in states]) for i in range(len(factors))]
        with stacked_adapters(factors, stacks):
            got = model(input_ids=ids.repeat(3, 1)).logits
        after = model(input_ids=ids).logits  # the plain forward is back
    torch.testing.assert_close(got, torch.cat(expected), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(after, expected[-1])
    assert all("forward" not in vars(f) for f in factors)


def test_unknown_targets_are_named(tiny_path: Path) -> None:
    model, _ = load_model(tiny_path)
    with pytest.raises(LeantrainError, match="qkv"):
        add_lora(model, r=4, alpha=8, targets=["qkv"])
    with (
        pytest.raises(LeantrainError, match="2 stacks for 1"),
        stacked_adapters([torch.nn.Linear(2, 2)], [torch.zeros(1, 2, 2)] * 2),
    ):
        pass
