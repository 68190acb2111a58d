"""The settings machinery every area's config models share: the strict pydantic base, YAML
loading with dotted overrides, and errors that name the field. No area's fields live here: each
area owns its models in its own `config.py` (`leantrain.rl.config.RLConfig`,
`leantrain.zo.config.ZOConfig`, ...)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from leantrain.errors import LeantrainError


class Strict(BaseModel):
    """Base of every config model: a misspelt key is an error, not a silently ignored setting."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


SettingsT = TypeVar("SettingsT", bound=BaseModel)


def format_validation_error(err: ValidationError, source: str) -> str:
    """One line per problem: `source: field.path: message (got value)`."""
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(top level)"
        got = f" (got {e['input']!r})" if "input" in e and not isinstance(e["input"], dict) else ""
        lines.append(f"{source}: {loc}: {e['msg']}{got}")
    return "\n".join(lines)


def load_settings(cls: type[SettingsT], path: str | Path | None, **overrides: Any) -> SettingsT:
    """Load a YAML file into the pydantic model `cls` (its defaults when `path` is None), after
    applying dotted overrides whose value is not None, e.g.
    `load_settings(RLConfig, "configs/tiny-arith.yaml", steps=4, **{"grpo.lr": 1e-4})`. Every
    area's settings load through here, so a bad file or field always fails the same way: a
    LeantrainError naming the field."""
    data: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        source = str(path)
        p = Path(path)
        if not p.is_file():
            raise LeantrainError(f"config file not found: {p}")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise LeantrainError(f"{p}: not valid YAML: {e}") from None
        if not isinstance(data, dict):
            raise LeantrainError(f"{p}: expected a mapping of settings, got {type(data).__name__}")
    for dotted, value in overrides.items():
        if value is None:
            continue
        node = data
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        raise LeantrainError(format_validation_error(e, source)) from None
