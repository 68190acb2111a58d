"""Settings of a run spread over ranks (the number of ranks is torchrun's, not a setting)."""

from __future__ import annotations

from pydantic import Field

from leantrain.settings import Strict


class DistributedConfig(Strict):
    """How ranks wait for each other (distributed/process_group.py)."""

    timeout_s: float = Field(
        600.0,
        gt=0.0,
        description="Longest wait for the other ranks: the rendezvous and every collective. A "
        "rank that dies is noticed at once; one that stalls ends the run with a RankError after "
        "this long. It must exceed the longest time rank 0 spends alone, generating a step's "
        "rollouts or evaluating, since the other ranks wait for the batch meanwhile.",
    )
