"""The settings machinery: YAML loading, dotted overrides, `-o key.path=value` parsing, and errors
that name the field (an unknown one with the valid ones beside it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import Field

from leantrain.errors import LeantrainError
from leantrain.settings import Strict, load_settings, parse_overrides


class Optimizer(Strict):
    lr: float = Field(1e-3, gt=0.0, description="Learning rate.")
    nesterov: bool = Field(False, description="Nesterov momentum.")
    milestones: list[int] = Field(default_factory=lambda: [10], description="Decay steps.")


class Run(Strict):
    optimizer: Optimizer = Field(default_factory=Optimizer, description="The optimizer.")
    teacher: Optimizer | None = Field(None, description="An optional second optimizer.")
    options: dict[str, Any] = Field(default_factory=dict, description="Free-form options.")
    steps: int = Field(1, ge=0, description="Steps.")
    name: str = Field("run", description="Name.")
    threads: int | None = Field(None, ge=1, description="Threads.")


def _yaml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


def test_defaults_file_and_dotted_overrides(tmp_path: Path) -> None:
    assert load_settings(Run) == Run()
    path = _yaml(tmp_path, "optimizer: {lr: 0.5}\nsteps: 3\nthreads: 2\n")
    cfg = load_settings(Run, path, **{"optimizer.nesterov": True, "steps": 4, "threads": None})
    assert cfg.optimizer.lr == 0.5 and cfg.optimizer.nesterov and cfg.steps == 4
    assert cfg.threads is None  # None is a value like any other: it sets the field


def test_override_strings_parse_as_yaml_values(tmp_path: Path) -> None:
    items = [
        "optimizer.lr=1e-4",
        "optimizer.nesterov=true",
        "optimizer.milestones=[0, 2]",
        "steps=7",
        "name=a=b",  # the first `=` splits
        "options.depth.max=3",
        "threads=null",
    ]
    cfg = load_settings(Run, _yaml(tmp_path, "threads: 2\n"), **parse_overrides(items))
    assert cfg.optimizer == Optimizer(lr=1e-4, nesterov=True, milestones=[0, 2])
    assert cfg.steps == 7 and cfg.name == "a=b" and cfg.threads is None
    assert cfg.options == {"depth": {"max": 3}}
    assert parse_overrides(["steps=1", "steps=2"]) == {"steps": 2}  # the last one wins


@pytest.mark.parametrize("item", ["steps", "=3", "optimizer..lr=1", "steps=[1"])
def test_malformed_override_is_refused(item: str) -> None:
    with pytest.raises(LeantrainError, match="override"):
        parse_overrides([item])


@pytest.mark.parametrize(
    ("item", "message"),
    [
        (
            "optimizer.lrr=1",
            "override optimizer.lrr: unknown field; valid: lr, nesterov, milestones",
        ),
        (
            "optimiser.lr=1",
            "override optimiser.lr: optimiser: unknown field; valid: optimizer, teacher, options, "
            "steps, name, threads",
        ),
        ("teacher.lrr=1", "override teacher.lrr: unknown field; valid: lr, nesterov, milestones"),
        ("optimizer.lr=-1", "override optimizer.lr: Input should be greater than 0 (got -1)"),
        ("steps=many", "override steps: Input should be a valid integer"),
    ],
)
def test_bad_override_names_its_key(item: str, message: str) -> None:
    with pytest.raises(LeantrainError) as err:
        load_settings(Run, None, **parse_overrides([item]))
    assert str(err.value).startswith(message)


def test_override_below_a_plain_value_is_refused(tmp_path: Path) -> None:
    with pytest.raises(LeantrainError, match=r"override name\.first: name is 'run', not a mapping"):
        load_settings(Run, _yaml(tmp_path, "name: run\n"), **{"name.first": 1})


def test_bad_file_field_is_named_with_the_valid_ones(tmp_path: Path) -> None:
    path = _yaml(tmp_path, "optimizer: {lr: 0.1, momentum: 0.9}\nsteps: -1\n")
    with pytest.raises(LeantrainError) as err:
        load_settings(Run, path)
    assert str(err.value).splitlines() == [
        f"{path}: optimizer.momentum: unknown field; valid: lr, nesterov, milestones (got 0.9)",
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
