"""Scale-out on torch.distributed: joining the process group torchrun describes (with a named
error for a missing or dead rank), FSDP2 sharding of a Hugging Face model, launching N local
ranks (torchrun) or placing them on a Ray cluster (`ray_group`, Ray imported only there),
data-parallel SFT step hooks, and DeepSpeed-Ulysses sequence parallelism (attention, the SFT step
hooks, and the pieces the GRPO learner splits its packed rows with).

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
from leantrain.distributed.ray_group import Placed, run_group
from leantrain.distributed.sequence import (
    SequenceParallelHooks,
    all_reduce_grads,
    check_model,
    check_ranks,
    gather_owned,
    sequence_group,
    sequence_parallel_backward,
    shard_batch,
    shard_row,
)
from leantrain.distributed.ulysses import (
    COMM,
    check_heads,
    heads_to_seq,
    packed_sequences,
    register,
    seq_to_heads,
)

__all__ = [
    "COMM",
    "DataParallelHooks",
    "Placed",
    "RankError",
    "SequenceParallelHooks",
    "World",
    "all_reduce_grads",
    "balanced_split",
    "broadcast",
    "check_heads",
    "check_model",
    "check_ranks",
    "collective",
    "data_parallel_backward",
    "decoder_layers",
    "free_port",
    "full_state_dict",
    "gather_owned",
    "heads_to_seq",
    "join",
    "launched_by_torchrun",
    "leave",
    "packed_sequences",
    "register",
    "run_group",
    "run_torchrun",
    "seq_to_heads",
    "sequence_group",
    "sequence_parallel_backward",
    "shard",
    "shard_batch",
    "shard_row",
    "single",
    "torchrun_command",
]
