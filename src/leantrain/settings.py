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
    """Base of every settings model: a misspelt key is an error, not a silently ignored setting,
    and a bad value, from YAML or from Python, raises a LeantrainError naming the field."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    def __init__(self, /, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as e:
            raise LeantrainError(describe_errors(e, type(self))) from None

    # Only a model built in Python comes through here: marked as pydantic's own __init__ (as
    # pydantic marks RootModel's), a nested model validates inside its parent and its errors
    # stay the parent's, with their full field path.
    __init__.__pydantic_base_init__ = True  # type: ignore[attr-defined]


SettingsT = TypeVar("SettingsT", bound=BaseModel)


def describe_errors(err: ValidationError, cls: type[BaseModel], source: str | None = None) -> str:
    """One line per problem: `source: field.path: message (got value)`, where source is a file
    or `defaults`; with no source (a model built in Python) `Class.field.path: message`."""
    lines = []
    for e in err.errors():
        loc = tuple(str(p) for p in e["loc"])
        got = f" (got {e['input']!r})" if "input" in e and not isinstance(e["input"], dict) else ""
        if source is None:
            lines.append(f"{'.'.join((cls.__name__, *loc))}: {e['msg']}{got}")
        else:
            lines.append(f"{source}: {'.'.join(loc) or '(top level)'}: {e['msg']}{got}")
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
        raise LeantrainError(describe_errors(e, cls, source)) from None
