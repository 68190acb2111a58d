"""The inference-workload engine: batched states equal sequential ones, the same trajectory as
MeZO's reference loop, and ZO that learns."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from leantrain.errors import LeantrainError
from leantrain.models import load_model
from leantrain.tasks import make_task
from leantrain.zo.data import example_pairs, mean_loss, sample_batch
from leantrain.zo.engine import ZOEngine
from leantrain.zo.estimators import SPSA, OneSided
from leantrain.zo.lora import add_lora
from leantrain.zo.reference import MeZOReference


@pytest.fixture(scope="module")
def tiny_and_pairs(tiny_path: Path):
    model, tokenizer = load_model(tiny_path)
    pairs = example_pairs(tokenizer, make_task("sentiment").examples(64, 0))
    return model, tokenizer, pairs


def lora_copy(model, seed: int = 0):
    torch.manual_seed(seed)  # LoRA's A is initialised from the global generator
    return add_lora(copy.deepcopy(model), r=4, alpha=8, targets=["q_proj", "v_proj"])


def trainable(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters() if p.requires_grad]


@pytest.mark.parametrize("estimator", [SPSA(eps=1e-2, directions=3), OneSided(1e-2, 3)])
def test_one_batched_forward_scores_like_sequential_forwards(tiny_and_pairs, estimator) -> None:
    base, tokenizer, pairs = tiny_and_pairs
    batch = sample_batch(pairs, 6, 0)
    results, weights = [], []
    for batched in (True, False):
        model = lora_copy(base)
        engine = ZOEngine(model, estimator, 1e-3, 0, tokenizer.pad_token_id, batched=batched)
        results.append(engine.step(batch))
        weights.append(trainable(model))
    states = 2 * 3 if isinstance(estimator, SPSA) else 1 + 3
    assert len(results[0].losses) == states
    assert results[0].losses == pytest.approx(results[1].losses, rel=1e-6)
    assert results[0].grads == pytest.approx(results[1].grads, rel=1e-3, abs=1e-6)
    for a, b in zip(*weights, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


@pytest.mark.parametrize("lean", [True, False])
@pytest.mark.parametrize("target", ["lora", "all"])
def test_same_seeds_same_losses_as_the_reference(tiny_and_pairs, target, lean) -> None:
    base, tokenizer, pairs = tiny_and_pairs
    models = [lora_copy(base) if target == "lora" else copy.deepcopy(base) for _ in range(2)]
    if target == "all":
        for m in models:
            m.requires_grad_(True)
    eps, lr = (1e-2, 1e-3) if target == "lora" else (1e-3, 1e-4)
    ref = MeZOReference(models[0], eps, lr, 7, tokenizer.pad_token_id)
    pad = tokenizer.pad_token_id
    ours = ZOEngine(models[1], SPSA(eps), lr, 7, pad, batched=target == "lora", lean=lean)
    assert (ours.lean is not None) == lean  # the tiny model is a Llama: packed scoring applies
    for step in range(3):
        batch = sample_batch(pairs, 8, step)
        expected, got = ref.step(batch), ours.step(batch)
        # Same weights, seeds and batch; only the summation order of the loss differs.
        assert got.losses == pytest.approx(expected.losses, rel=1e-5)
    for a, b in zip(trainable(models[0]), trainable(models[1]), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_zo_reduces_the_loss(tiny_and_pairs) -> None:
    base, tokenizer, pairs = tiny_and_pairs
    model = lora_copy(base)
    train = pairs[:8]
    before = mean_loss(model, train, tokenizer.pad_token_id)
    engine = ZOEngine(model, SPSA(eps=1e-2, directions=2), 3e-3, 0, tokenizer.pad_token_id)
    for _ in range(15):
        engine.step(train)
    after = mean_loss(model, train, tokenizer.pad_token_id)
    assert after < before - 0.3, (before, after)


def test_sparse_steps_leave_large_weights_alone(tiny_and_pairs) -> None:
    base, tokenizer, pairs = tiny_and_pairs
    model = copy.deepcopy(base).requires_grad_(True)
    before = trainable(model)
    engine = ZOEngine(model, SPSA(1e-3), 1e-3, 0, tokenizer.pad_token_id, sparse_fraction=0.1)
    engine.step(sample_batch(pairs, 4, 0))
    for old, new in zip(before, trainable(model), strict=True):
        large = old.abs() > old.abs().flatten().kthvalue(max(1, round(0.1 * old.numel()))).values
        torch.testing.assert_close(new[large], old[large], rtol=0, atol=1e-6)
        changed = (new != old).float().mean()
        assert 0 < changed <= 0.11


def test_batched_needs_lora_factors_only(tiny_and_pairs) -> None:
    base, tokenizer, _ = tiny_and_pairs
    model = copy.deepcopy(base).requires_grad_(True)
    with pytest.raises(LeantrainError, match="LoRA factors"):
        ZOEngine(model, SPSA(1e-3), 1e-3, 0, tokenizer.pad_token_id, batched=True)
