"""A GRPO run's settings: bad input names the field; `sampling` is the engine's SamplingParams."""

from __future__ import annotations

from pathlib import Path

import pytest

from leantrain.errors import LeantrainError
from leantrain.generation import SamplingParams
from leantrain.rl.config import RLConfig
from leantrain.settings import load_settings


def test_overrides_apply_dotted_keys() -> None:
    cfg = load_settings(RLConfig, None, **{"grpo.lr": 3e-4, "steps": 7})
    assert cfg.grpo.lr == 3e-4 and cfg.steps == 7 and cfg.model.name == "tiny"


def test_sampling_is_the_engines_sampling_params() -> None:
    cfg = load_settings(RLConfig, None, **{"sampling.max_new_tokens": 48, "sampling.stop": ["\n"]})
    assert cfg.sampling == SamplingParams(max_new_tokens=48, temperature=0.7, stop=("\n",))
    assert RLConfig().sampling == SamplingParams()  # one set of defaults: 320 tokens at 0.7


@pytest.mark.parametrize(
    ("yaml_text", "field"),
    [
        ("grpo:\n  lr: -1\n", "grpo.lr"),
        ("grpo:\n  loss_type: ppo\n", "grpo.loss_type"),
        ("sampling:\n  top_p: 2\n", "sampling.top_p"),
        ("steps: many\n", "steps"),
        ("grpo:\n  learning_rate: 0.1\n", "grpo.learning_rate"),  # misspelt key
        ("task:\n  reward_weights: {answer: .nan}\n", "task.reward_weights.answer"),
    ],
)
def test_bad_field_is_named(tmp_path: Path, yaml_text: str, field: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(yaml_text)
    with pytest.raises(LeantrainError, match=rf"bad\.yaml: {field}:"):
        load_settings(RLConfig, path)


def test_misspelt_key_lists_the_valid_ones(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("grpo:\n  learning_rate: 0.1\n")
    with pytest.raises(LeantrainError, match="unknown field; valid: prompts_per_step, group_size"):
        load_settings(RLConfig, path)
