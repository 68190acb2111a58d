"""The rollout backend protocol: capabilities are declared, and a missing one is refused by name."""

from __future__ import annotations

import pytest
import torch

from leantrain.errors import LeantrainError
from leantrain.generation import Capabilities, Engine, require, weights_snapshot
from leantrain.models import load_model


class _PlainBackend:
    """A backend that only samples: no hidden states, images, speculation or KV budget."""

    capabilities = Capabilities()

    def generate(self, prompts, params, *, seed=None, **options):
        raise AssertionError("not called in these tests")

    def load_weights(self, weights, version):
        raise AssertionError("not called in these tests")


def test_require_names_the_setting_and_the_missing_capability() -> None:
    with pytest.raises(LeantrainError, match=r"max_cache_tokens needs .* kv budget; _PlainBackend"):
        require(_PlainBackend(), "kv_budget", "max_cache_tokens")
    with pytest.raises(ValueError, match="unknown capability"):
        require(_PlainBackend(), "kv_budgets", "max_cache_tokens")


def test_the_engine_has_every_capability_and_loads_weights_by_name(tiny_path) -> None:
    model, tok = load_model(tiny_path)
    engine = Engine(model, tok)
    for name in ("hidden_states", "images", "speculation", "kv_budget"):
        require(engine, name, "a setting")  # does not raise
    moved = {k: v + 1.0 for k, v in model.state_dict().items()}
    engine.load_weights(moved, version=3)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, moved[name]), name


def test_a_weights_snapshot_is_a_copy_the_producer_can_go_on_training() -> None:
    producer = torch.nn.Linear(3, 2)
    snapshot = weights_snapshot(producer)
    before = {k: v.clone() for k, v in snapshot.items()}
    with torch.no_grad():
        producer.weight.add_(1.0)  # the learner's in-place update after publishing
    assert snapshot.keys() == {"weight", "bias"}
    for name, tensor in snapshot.items():
        assert torch.equal(tensor, before[name]) and not tensor.requires_grad, name
