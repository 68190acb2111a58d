"""Ray placement settings, checked before any Ray starts: each refusal names its setting (the
placement itself runs on a 2-node cluster in tests/distributed/test_ray_group.py)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from leantrain.cli import app
from leantrain.errors import LeantrainError
from leantrain.rl.config import RLConfig
from leantrain.rl.ray_placement import run_learner_group
from leantrain.settings import load_settings


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (
            {"orchestrator.ray_rollout_resource": "rollout"},
            r"orchestrator\.ray_rollout_resource: .*needs backend: ray \(got 'local'\)",
        ),
        (
            {"distributed.ray_learner_ranks": 2},
            r"distributed\.ray_learner_ranks: .*needs ray_learner_resource",
        ),
    ],
)
def test_a_placement_setting_without_what_it_needs_is_named(settings, message) -> None:
    with pytest.raises(LeantrainError, match=message):
        load_settings(RLConfig, None, **settings)


def test_several_learner_ranks_with_lora_are_not_wired() -> None:
    cfg = load_settings(
        RLConfig,
        None,
        **{
            "lora.enabled": True,
            "distributed.ray_learner_resource": "learner",
            "distributed.ray_learner_ranks": 2,
        },
    )
    with pytest.raises(NotImplementedError, match=r"ray_learner_ranks 2 with lora.*issue 24"):
        run_learner_group(cfg)


def test_nproc_per_node_and_ray_learners_exclude_each_other() -> None:
    result = CliRunner().invoke(
        app,
        ["rl", "--nproc-per-node", "2", "-o", "distributed.ray_learner_resource=learner"],
    )
    assert result.exit_code == 2
    assert "distributed.ray_learner_ranks" in result.output
