"""Scale-out on torch.distributed: joining the process group torchrun describes (with a named
error for a missing or dead rank), FSDP2 sharding of a Hugging Face model, launching N local
ranks, data-parallel SFT step hooks, and DeepSpeed-Ulysses sequence parallelism (attention and
the SFT step hooks).

Sits beside `speculation` above `training`/`generation` and below `rl`: it knows models and
process groups, never trajectories or losses."""

from leantrain.distributed.data_parallel import DataParallelHooks, data_parallel_backward
from leantrain.distributed.fsdp import balanced_split, decoder_layers, full_state_dict, shard
from leantrain.distributed.launch import free_port, run_torchrun, torchrun_command
from leantrain.distributed.process_group import (
    RankError,
    World,
    broadcast,
    collective,
    join,
    launched_by_torchrun,
    leave,
    single,
)
from leantrain.distributed.sequence import (
    SequenceParallelHooks,
    all_reduce_grads,
    sequence_parallel_backward,
    shard_batch,
)
from leantrain.distributed.ulysses import (
    COMM,
    check_heads,
    heads_to_seq,
    register,
    seq_to_heads,
)

__all__ = [
    "COMM",
    "DataParallelHooks",
    "RankError",
    "SequenceParallelHooks",
    "World",
    "all_reduce_grads",
    "balanced_split",
    "broadcast",
    "check_heads",
    "collective",
    "data_parallel_backward",
    "decoder_layers",
    "free_port",
    "full_state_dict",
    "heads_to_seq",
    "join",
    "launched_by_torchrun",
    "leave",
    "register",
    "run_torchrun",
    "seq_to_heads",
    "sequence_parallel_backward",
    "shard",
    "shard_batch",
    "single",
    "torchrun_command",
]
