"""The learner group of a GRPO run placed on a Ray cluster: `run_learner_group` runs the whole
run as a group of learner-rank actors (distributed/ray_group.py) on the nodes offering
`distributed.ray_learner_resource`, each with torchrun's environment; rank 0's run then starts
its rollout workers (rl/ray_backend.py) from there.

Sits above rl/grpo.py (each rank runs a `GRPORun`); nothing in the run imports it back.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from leantrain.distributed.ray_group import Placed, connect, gpus_each, import_ray, run_group
from leantrain.errors import LeantrainError
from leantrain.rl.config import RLConfig
from leantrain.rl.grpo import GRPORun


def train_rank(config: RLConfig, resume: bool) -> dict[str, Any]:
    """One learner rank of a GRPO run (torchrun's environment already set): rank 0's summary,
    {} on the other ranks."""
    return GRPORun(config, progress=False, resume=resume).run()


def run_learner_group(config: RLConfig, resume: bool = False) -> list[Placed]:
    """Run `config` with its learner ranks placed on the Ray cluster by
    `distributed.ray_learner_resource` (and, in async mode on the ray backend, its rollout
    workers by `orchestrator.ray_rollout_resource`); returns each rank's placement, rank 0's
    value being the run summary. Disconnects from Ray at the end if it connected."""
    d, o = config.distributed, config.orchestrator
    if d.ray_learner_resource is None:
        raise LeantrainError("run_learner_group needs distributed.ray_learner_resource")
    if d.ray_learner_ranks > 1 and (config.speculative.enabled or config.lora.enabled):
        # GRPORun refuses these on more than one rank; said here, before any actor is placed.
        raise NotImplementedError(
            f"distributed.ray_learner_ranks {d.ray_learner_ranks} with "
            + ("speculative.enabled" if config.speculative.enabled else "lora.enabled")
            + " is not wired yet (issue 24): more than one learner rank runs without "
            "speculation or LoRA; use ray_learner_ranks 1"
        )
    ray = import_ray("distributed.ray_learner_resource")
    connected = ray.is_initialized()
    connect(o.ray_address)
    try:
        # The ranks may run in another working directory, or on another node: rank 0 writes
        # the run folder at this absolute path on its node.
        config = config.model_copy(update={"out": Path(config.out).resolve()})
        return run_group(
            train_rank,
            (config, resume),
            ranks=d.ray_learner_ranks,
            resource=d.ray_learner_resource,
            timeout_s=d.timeout_s,
            gpus_per_rank=gpus_each(ray, config.device, d.ray_learner_resource),
        )
    finally:
        if not connected:
            ray.shutdown()
