"""Every YAML under configs/ loads through the settings model of the command that takes it."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import BaseModel

from leantrain.settings import load_settings

CONFIGS = sorted((Path(__file__).parents[1] / "configs").glob("*.yaml"))


def _config_class(name: str) -> type[BaseModel]:
    """The settings model each shipped config is for (the command that takes it)."""
    from leantrain.data.config import ValueConfig
    from leantrain.memory.config import TuneConfig
    from leantrain.rl.config import RLConfig
    from leantrain.safety.config import AuditConfig, ElicitConfig, UnlearnConfig
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
