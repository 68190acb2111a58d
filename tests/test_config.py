"""Config loading: every shipped YAML validates, and bad input names the field."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import BaseModel

from leantrain.cli.rl import DEMO_SETTINGS
from leantrain.config import RLConfig, load_config, load_settings
from leantrain.errors import LeantrainError

CONFIGS = sorted((Path(__file__).parents[1] / "configs").glob("*.yaml"))


def _config_class(name: str) -> type[BaseModel]:
    """The settings model each shipped config is for (the command that takes it)."""
    from leantrain.data.valuation import ValueConfig
    from leantrain.memory.sft import TuneConfig
    from leantrain.safety.audit import AuditConfig
    from leantrain.safety.elicit import ElicitConfig
    from leantrain.safety.unlearn import UnlearnConfig
    from leantrain.zo.config import ZOConfig

    classes = {
        "audit": AuditConfig,
        "elicit": ElicitConfig,
        "unlearn": UnlearnConfig,
        "value": ValueConfig,
        "tiny-sft": TuneConfig,
        "tiny-zo": ZOConfig,
        "tiny-arith": RLConfig,
        "tiny-tools": RLConfig,
        "tiny-vl": RLConfig,
    }
    matches = [cls for prefix, cls in classes.items() if name.startswith(prefix)]
    assert len(matches) == 1, f"configs/{name}: say which settings model it is for"
    return matches[0]


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_loads(path: Path) -> None:
    cls = _config_class(path.name)
    cfg = load_settings(cls, path)
    assert isinstance(cfg, cls)  # extra keys are forbidden, so a misspelt one fails here


def test_demo_config_matches_the_demo() -> None:
    # `leantrain demo` runs the defaults plus DEMO_SETTINGS; configs/tiny-arith.yaml documents
    # the same run.
    shipped = load_config(Path(__file__).parents[1] / "configs" / "tiny-arith.yaml")
    demo = load_config(None, **DEMO_SETTINGS)
    assert shipped.model_dump(exclude={"out"}) == demo.model_dump(exclude={"out"})


def test_overrides_apply_dotted_keys() -> None:
    cfg = load_config(None, **{"grpo.lr": 3e-4, "steps": 7, "model.name": None})
    assert cfg.grpo.lr == 3e-4 and cfg.steps == 7 and cfg.model.name == "tiny"


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
        load_config(path)


def test_missing_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(LeantrainError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(LeantrainError, match="expected a mapping"):
        load_config(tmp_path / "list.yaml")
    (tmp_path / "broken.yaml").write_text("a: [1\n")
    with pytest.raises(LeantrainError, match="not valid YAML"):
        load_config(tmp_path / "broken.yaml")
