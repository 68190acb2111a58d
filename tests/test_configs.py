"""Every YAML under configs/ names its settings model on its first line and loads through it."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest
from pydantic import BaseModel

from leantrain.settings import load_settings

CONFIGS = sorted((Path(__file__).parents[1] / "configs").glob("*.yaml"))
NAMED = re.compile(r"# settings: (?P<module>[\w.]+)\.(?P<model>\w+)\s*")


def settings_model(path: Path) -> type[BaseModel]:
    """The model named by the file's first line, `# settings: package.module.Model`."""
    lines = path.read_text().splitlines()
    first = lines[0] if lines else ""
    named = NAMED.fullmatch(first)
    assert named, f"configs/{path.name}: first line must be `# settings: module.Model`"
    model = getattr(importlib.import_module(named["module"]), named["model"])
    assert isinstance(model, type) and issubclass(model, BaseModel), first
    return model


def test_there_are_configs() -> None:
    assert CONFIGS


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_loads_through_its_named_model(path: Path) -> None:
    model = settings_model(path)
    assert isinstance(load_settings(model, path), model)  # extra keys are forbidden
