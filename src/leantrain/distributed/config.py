"""Settings of a run spread over ranks (the number of ranks is torchrun's, not a setting; how
they split the work is)."""

from __future__ import annotations

from pydantic import Field

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
        description="Ranks that split each packed micro-batch's row between them (Ulysses "
        "sequence parallelism: two all-to-alls around every attention, each rank holding 1/P of "
        "the tokens' activations); the ranks form world/P data-parallel groups. 1: plain data "
        "parallelism. Trades a little communication per layer for activation memory that no "
        "longer grows with the whole row on one rank: raise it when one micro-batch's "
        "activations do not fit. Must divide the number of ranks and the model's attention "
        "heads; Llama/Qwen2-style models (GQA included), text only.",
    )
