from pathlib import Path

import pytest

from leantrain.config import load_settings
from leantrain.errors import LeantrainError
from leantrain.safety.audit import AuditConfig
from leantrain.safety.elicit import ElicitConfig
from leantrain.safety.unlearn import UnlearnConfig

CONFIGS = Path(__file__).parents[2] / "configs"
SHIPPED = [
    ("unlearn-npo.yaml", UnlearnConfig),
    ("unlearn-rmu-multilayer.yaml", UnlearnConfig),
    ("audit.yaml", AuditConfig),
    ("elicit-tiny.yaml", ElicitConfig),
]


@pytest.mark.parametrize(("name", "cls"), SHIPPED)
def test_shipped_configs_load(name, cls):
    assert isinstance(load_settings(cls, CONFIGS / name), cls)


def test_bad_fields_name_the_field():
    with pytest.raises(LeantrainError, match="method"):
        load_settings(UnlearnConfig, None, method="forget-harder")
    with pytest.raises(LeantrainError, match="n_demos"):
        load_settings(ElicitConfig, None, n_demos=0)
