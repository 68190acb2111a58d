"""The one rollout path: a setting the backend cannot serve is refused at set-up, by name."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from leantrain.errors import LeantrainError
from leantrain.generation import Capabilities, Engine
from leantrain.models import load_model
from leantrain.rl.config import RLConfig
from leantrain.rl.episodes import EpisodeRunner
from leantrain.rl.rollout import RolloutSource
from leantrain.settings import load_settings
from leantrain.tasks import make_task


class _PlainBackend:
    capabilities = Capabilities()

    def generate(self, prompts, params, *, seed=None, **options):
        raise AssertionError("a refused source never samples")

    def load_weights(self, weights, version):
        raise AssertionError("a refused source never loads")


@pytest.mark.parametrize(
    ("overrides", "long_tail", "setting"),
    [
        ({"max_cache_tokens": 256}, None, "max_cache_tokens"),
        ({}, SimpleNamespace(capture=False), "speculative.enabled"),
    ],
)
def test_a_backend_without_the_capability_is_refused_at_set_up(
    tiny_path, overrides, long_tail, setting
) -> None:
    _, tok = load_model(tiny_path)
    cfg = load_settings(RLConfig, None, **overrides)
    with pytest.raises(LeantrainError, match=setting.replace(".", r"\.")):
        RolloutSource(
            cfg, _PlainBackend(), tok, make_task("arith"), torch.device("cpu"), None, long_tail
        )


def test_episodes_pass_on_no_hidden_states_so_drafter_training_is_refused(tiny_path) -> None:
    model, tok = load_model(tiny_path)
    runner = EpisodeRunner(Engine(model, tok), make_task("tool_arith"))
    assert not runner.capabilities.hidden_states and runner.capabilities.kv_budget
    training = SimpleNamespace(capture=True)  # a long tail whose drafter trains online
    with pytest.raises(LeantrainError, match=r"speculative\.train_drafter needs .* hidden states"):
        RolloutSource(
            load_settings(RLConfig, None),
            runner,
            tok,
            runner.env,
            torch.device("cpu"),
            None,
            training,
        )
