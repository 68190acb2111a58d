"""The settings machinery every area's config models share: the strict pydantic base, YAML
loading with dotted overrides (`-o key.path=value` on the command line), and errors that name the
field. No area's fields live here: each area owns its models in its own `config.py`
(`leantrain.rl.config.RLConfig`, `leantrain.zo.config.ZOConfig`, ...)."""

from __future__ import annotations

import os
import types
import typing
from collections.abc import Collection, Iterable, Mapping
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


def leantrain_home() -> Path:
    """Where leantrain keeps its files (preset builds, drafters, the register of running
    commands): `$LEANTRAIN_HOME`, default `~/.cache/leantrain`."""
    return Path(os.environ.get("LEANTRAIN_HOME", Path.home() / ".cache" / "leantrain"))


def load_settings(
    cls: type[SettingsT], path: str | Path | None = None, **overrides: Any
) -> SettingsT:
    """Load a YAML file into the pydantic model `cls` (its defaults when `path` is None), after
    setting each dotted override, e.g.
    `load_settings(RLConfig, "configs/tiny-arith.yaml", steps=4, **{"grpo.lr": 1e-4})`.
    Every area's settings load through here, so a bad file, field or override always fails the
    same way: a LeantrainError naming the field (an unknown one with the valid ones beside it)."""
    data: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        source = str(path)
        data = _read_yaml(Path(path))
    for dotted, value in overrides.items():
        _set(data, dotted, value)
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        raise LeantrainError(describe_errors(e, cls, source, overrides)) from None


def parse_overrides(items: Iterable[str]) -> dict[str, Any]:
    """`key.path=value` strings (the command line's `-o`) -> {dotted key: value}, each value
    read as a YAML scalar or flow collection: `1e-4`, `true`, `null`, `[0, 2]` mean what they
    would mean in the config file. A later item for the same key wins."""
    parsed: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key or not all(key.split(".")):
            raise LeantrainError(f"override {item!r}: expected key.path=value, e.g. grpo.lr=1e-4")
        try:
            parsed[key] = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise LeantrainError(f"override {key}: not a YAML value: {text!r} ({e})") from None
    return parsed


def describe_errors(
    err: ValidationError,
    cls: type[BaseModel],
    source: str | None = None,
    overridden: Collection[str] = (),
) -> str:
    """One line per problem: `source: field.path: message (got value)`, where source is the
    override that set the field, else `source` (a file, or `defaults`); with no source at all
    (a model built in Python) `Class.field.path: message`. An unknown field's line lists the
    valid fields at its level."""
    lines = []
    for e in err.errors():
        loc = tuple(str(p) for p in e["loc"])
        dotted = ".".join(loc)
        if e["type"] == "extra_forbidden":
            message = f"unknown field; valid: {', '.join(field_names(cls, loc[:-1]))}"
        else:
            message = e["msg"]
        got = f" (got {e['input']!r})" if "input" in e and not isinstance(e["input"], dict) else ""
        if source is None:
            lines.append(f"{'.'.join((cls.__name__, *loc))}: {message}{got}")
            continue
        # The override whose path covers the field, or passes through it (an unknown section).
        setter = next((k for k in overridden if _covers(k, dotted) or _covers(dotted, k)), None)
        if setter is None:
            lines.append(f"{source}: {dotted or '(top level)'}: {message}{got}")
        else:
            field = "" if dotted == setter else f" {dotted or '(top level)'}:"
            lines.append(f"override {setter}:{field} {message}{got}")
    return "\n".join(lines)


def _covers(outer: str, inner: str) -> bool:
    """True when the dotted path `inner` is `outer` or lies inside it."""
    return bool(outer) and (inner == outer or inner.startswith(f"{outer}."))


def field_names(cls: type[BaseModel], path: Iterable[str]) -> list[str]:
    """The fields of the settings model found by following `path` from `cls` (empty where the
    path leaves the models, e.g. into a free-form mapping)."""
    model: type[BaseModel] | None = cls
    for name in path:
        field = model.model_fields.get(name) if model is not None else None
        model = _nested_model(field.annotation) if field is not None else None
    return list(model.model_fields) if model is not None else []


def _nested_model(annotation: Any) -> type[BaseModel] | None:
    """The settings model a field holds, directly or as one arm of an optional."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        arms = [_nested_model(arm) for arm in typing.get_args(annotation)]
        return next((arm for arm in arms if arm is not None), None)
    return None


def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise LeantrainError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise LeantrainError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise LeantrainError(f"{path}: expected a mapping of settings, got {type(data).__name__}")
    return data


def _set(data: dict[str, Any], dotted: str, value: Any) -> None:
    """Set `data[a][b][c] = value` for `a.b.c`, creating the mappings on the way."""
    node = data
    *parents, leaf = dotted.split(".")
    for depth, key in enumerate(parents):
        node = node.setdefault(key, {})
        if not isinstance(node, Mapping):
            at = ".".join(parents[: depth + 1])
            raise LeantrainError(f"override {dotted}: {at} is {node!r}, not a mapping of settings")
    node[leaf] = value
