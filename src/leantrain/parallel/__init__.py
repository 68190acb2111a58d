"""Sequence parallelism: DeepSpeed-Ulysses attention as a transformers attention implementation,
batch sharding, the token-weighted loss across ranks, and step hooks for the SFT loop."""

from leantrain.parallel.training import (
    SequenceParallelHooks,
    all_reduce_grads,
    init_from_env,
    sequence_parallel_backward,
    shard_batch,
)
from leantrain.parallel.ulysses import COMM, check_heads, heads_to_seq, register, seq_to_heads

__all__ = [
    "COMM",
    "SequenceParallelHooks",
    "all_reduce_grads",
    "check_heads",
    "heads_to_seq",
    "init_from_env",
    "register",
    "seq_to_heads",
    "sequence_parallel_backward",
    "shard_batch",
]
