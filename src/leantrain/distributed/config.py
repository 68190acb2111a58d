"""Settings of a run spread over ranks (under torchrun the number of ranks is torchrun's, not a
setting; on Ray it is `ray_learner_ranks`)."""

from __future__ import annotations

from pydantic import Field, model_validator

from leantrain.settings import Strict


class DistributedConfig(Strict):
    """How ranks wait for each other (distributed/process_group.py) and how they split the
    learner's work (rl/learner.py)."""

    timeout_s: float = Field(
        600.0,
        gt=0.0,
        description="Longest wait for the other ranks: the rendezvous and every collective. A "
        "rank that dies is noticed at once; one that stalls ends the run with a RankError after "
        "this long. It must exceed the longest time rank 0 spends alone, generating a step's "
        "rollouts or evaluating, since the other ranks wait for the batch meanwhile.",
    )
    sequence_parallel_size: int = Field(
        1,
        ge=1,
        description="Ranks that split each sequence between them (Ulysses sequence "
        "parallelism: two all-to-alls around every attention, each rank holding 1/P of the "
        "tokens' activations): each packed micro-batch's row in `rl`, each row of a chunk in "
        "`tune` (`--sequence-parallel` sets it); the ranks form world/P data-parallel groups. "
        "1: plain data parallelism. Trades a little communication per layer for activation "
        "memory that no longer grows with the whole row on one rank: raise it when one "
        "micro-batch's activations do not fit. Must divide the number of ranks and the "
        "model's attention heads; Llama/Qwen2-style models (GQA included), text only.",
    )
    ray_learner_resource: str | None = Field(
        None,
        description="Ray placement of the learner group: `leantrain rl` connects to the Ray "
        "cluster at orchestrator.ray_address and runs the learner ranks as Ray actors on nodes "
        "that offer this custom resource (`ray start --resources '{\"learner\": 1}'`), each "
        "with torchrun's environment; rank 0 also generates, or drives the rollout workers. "
        "Any amount marks a node (on GPUs each rank also takes one GPU). None: ranks run here, "
        "under torchrun. A resource no node offers is refused at once.",
    )
    ray_learner_ranks: int = Field(
        1,
        ge=1,
        description="Learner ranks placed by distributed.ray_learner_resource, packed onto as "
        "few of its nodes as fit (data-parallel with FSDP2 above one, like --nproc-per-node).",
    )

    @model_validator(mode="after")
    def _ranks_need_the_resource(self) -> DistributedConfig:
        if self.ray_learner_ranks > 1 and self.ray_learner_resource is None:
            raise ValueError(
                f"ray_learner_ranks {self.ray_learner_ranks} places ranks on Ray: it needs "
                "ray_learner_resource (on this machine alone use --nproc-per-node)"
            )
        return self
