"""Joining and leaving: `leave` ends only a process group this process joined as a rank."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from leantrain.distributed import leave
from leantrain.distributed.launch import free_port
from leantrain.distributed.process_group import TORCHRUN_ENV


def test_leave_keeps_a_group_other_code_made_in_a_single_process_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An in-process vLLM engine makes a world of one; a single-process GRPO run ending with
    `leave()` destroyed it, and the next engine in the process failed on its dead groups."""
    for key in TORCHRUN_ENV:
        monkeypatch.delenv(key, raising=False)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        leave()
        assert dist.is_initialized()
    finally:
        dist.destroy_process_group()
