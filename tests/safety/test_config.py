from pathlib import Path

import pytest

from leantrain.errors import LeantrainError
from leantrain.safety.config import TUNED, AuditConfig, ElicitConfig, UnlearnConfig
from leantrain.settings import load_settings

CONFIGS = Path(__file__).parents[2] / "configs"


@pytest.mark.parametrize("name", ["unlearn-npo.yaml", "unlearn-rmu-multilayer.yaml"])
def test_shipped_unlearn_configs_are_the_tuned_settings(name):
    shipped = load_settings(UnlearnConfig, CONFIGS / name)
    assert shipped == UnlearnConfig(method=shipped.method)


def test_unlearn_settings_default_to_the_methods_tuned_values():
    for method, tuned in TUNED.items():
        cfg = UnlearnConfig(method=method)
        assert (cfg.steps, cfg.lr, cfg.retain_weight) == (
            tuned["steps"],
            tuned["lr"],
            tuned["retain_weight"],
        )
    # What the user sets wins over the tuned value (on the command line: tests/cli/test_common.py).
    assert UnlearnConfig(method="rmu", lr=0.5).lr == 0.5
    assert load_settings(UnlearnConfig, None, method="ga", steps=7).steps == 7
    assert load_settings(UnlearnConfig, None, method="ga").lr == TUNED["ga"]["lr"]


def test_bad_fields_name_the_field():
    with pytest.raises(LeantrainError, match="method"):
        load_settings(UnlearnConfig, None, method="forget-harder")
    with pytest.raises(LeantrainError, match="n_demos"):
        load_settings(ElicitConfig, None, n_demos=0)


def test_smollm2_settings_cover_its_methods_and_load():
    from leantrain.safety.config import AUDIT_BY_MODEL, METHODS, TUNED_BY_MODEL

    assert TUNED_BY_MODEL["tiny"] is TUNED
    for method, tuned in TUNED_BY_MODEL["smollm2-135m"].items():
        assert method in METHODS
        assert UnlearnConfig(method=method, **tuned).lr == tuned["lr"]
    AuditConfig(**AUDIT_BY_MODEL["smollm2-135m"])
    elicit = load_settings(ElicitConfig, CONFIGS / "elicit-smollm2.yaml")
    assert elicit.model == "smollm2-135m" and ElicitConfig().model == "tiny"
