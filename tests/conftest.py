"""Shared fixtures. Tests run offline on the built-in tiny model, built once per machine (about a
minute) into the normal cache and reused; pytest-xdist workers wait on its file lock."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from leantrain.rl.config import RLConfig
from leantrain.settings import load_settings


@pytest.fixture(scope="session", autouse=True)
def one_thread_per_worker():
    # Two xdist workers on two cores: one intra-op thread each avoids oversubscription.
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_path() -> Path:
    from leantrain.models import ensure_tiny

    return ensure_tiny(progress=False)


@pytest.fixture
def small_rl_config(tiny_path: Path, tmp_path: Path) -> RLConfig:
    """A GRPO run on the tiny model small enough for a test: 4 prompts x 4 samples, 48 tokens."""
    return load_settings(
        RLConfig,
        None,
        **{
            "steps": 2,
            "out": tmp_path / "run",
            "device": "cpu",
            "task.eval_size": 8,
            "sampling.max_new_tokens": 48,
            "grpo.prompts_per_step": 4,
            "grpo.group_size": 4,
            "grpo.lr": 1e-3,
            "checkpoint_every": 1,
        },
    )
