"""How a command's options become its settings: --config, then the shortcut options given, then
every `-o key.path=value`."""

from __future__ import annotations

from pathlib import Path

import pytest

from leantrain.cli.common import SHORTCUTS, command_settings, shortcut_overrides
from leantrain.errors import LeantrainError
from leantrain.rl.config import RLConfig
from leantrain.safety.config import TUNED, UnlearnConfig

CONFIGS = Path(__file__).parents[2] / "configs"


def test_shortcuts_set_their_field_and_options_not_given_are_skipped() -> None:
    assert shortcut_overrides(model="tiny-tools", steps=None, out=Path("r")) == {
        "model.name": "tiny-tools",
        "out": Path("r"),
    }
    assert SHORTCUTS["model"] == "model.name"


def test_overrides_come_last_and_parse_as_yaml() -> None:
    cfg = command_settings(
        RLConfig,
        CONFIGS / "tiny-arith.yaml",
        [
            "grpo.lr=1e-4",
            "orchestrator.mode=async",
            "speculative.draft_lengths=[0, 2]",
            "speculative.train_drafter=true",
            "steps=3",
        ],
        model="tiny-tools",
        steps=5,
    )
    assert cfg.grpo.lr == 1e-4 and cfg.orchestrator.mode == "async"
    assert cfg.speculative.draft_lengths == [0, 2] and cfg.speculative.train_drafter is True
    assert cfg.steps == 3 and cfg.model.name == "tiny-tools"  # -o wins over --steps
    assert cfg.grpo.lr_schedule == "cosine"  # the rest is the file's


def test_unlearn_options_not_given_keep_the_tuned_values() -> None:
    cfg = command_settings(UnlearnConfig, None, ["lr=0.5"], method="ga", steps=None)
    assert (cfg.steps, cfg.lr) == (TUNED["ga"]["steps"], 0.5)


def test_unknown_override_lists_the_valid_fields() -> None:
    with pytest.raises(LeantrainError, match=r"override grpo\.lrr: unknown field; valid: .*\blr\b"):
        command_settings(RLConfig, None, ["grpo.lrr=1e-4"])
