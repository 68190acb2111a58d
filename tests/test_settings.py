"""The settings machinery: YAML loading, dotted overrides and errors that name the field."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import Field

from leantrain.errors import LeantrainError
from leantrain.settings import Strict, load_settings


class Optimizer(Strict):
    lr: float = Field(1e-3, gt=0.0, description="Learning rate.")
    nesterov: bool = Field(False, description="Nesterov momentum.")


class Run(Strict):
    optimizer: Optimizer = Field(default_factory=Optimizer, description="The optimizer.")
    steps: int = Field(1, ge=0, description="Steps.")


def test_defaults_file_and_dotted_overrides(tmp_path: Path) -> None:
    assert load_settings(Run, None) == Run()
    path = tmp_path / "run.yaml"
    path.write_text("optimizer: {lr: 0.5}\nsteps: 3\n")
    cfg = load_settings(Run, path, **{"optimizer.nesterov": True, "steps": None})
    assert cfg.optimizer == Optimizer(lr=0.5, nesterov=True) and cfg.steps == 3


def test_bad_file_field_is_named(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("optimizer: {lr: 0.1, momentum: 0.9}\nsteps: -1\n")
    with pytest.raises(LeantrainError) as err:
        load_settings(Run, path)
    assert str(err.value).splitlines() == [
        f"{path}: optimizer.momentum: Extra inputs are not permitted (got 0.9)",
        f"{path}: steps: Input should be greater than or equal to 0 (got -1)",
    ]


def test_a_model_built_in_python_names_its_field() -> None:
    with pytest.raises(LeantrainError, match=r"^Run\.optimizer\.lr: Input should be greater"):
        Run(optimizer={"lr": 0})


def test_missing_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(LeantrainError, match="not found"):
        load_settings(Run, tmp_path / "nope.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(LeantrainError, match="expected a mapping"):
        load_settings(Run, tmp_path / "list.yaml")
    (tmp_path / "broken.yaml").write_text("a: [1\n")
    with pytest.raises(LeantrainError, match="not valid YAML"):
        load_settings(Run, tmp_path / "broken.yaml")
