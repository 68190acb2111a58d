"""Joining the process group torchrun describes, and the named error every collective raises when
a peer rank is missing, dead or stalled.

torchrun (or `torch.multiprocessing` in the tests) sets RANK, WORLD_SIZE, LOCAL_RANK and
MASTER_ADDR/PORT; `join` turns them into a `World`: gloo on CPU, NCCL on GPUs, and one timeout
for the rendezvous and for every collective after it, so a rank that never arrives or stops
answering ends the run with a `RankError` within that time instead of a silent hang. A rank that
dies outright closes its sockets and the others fail at their next collective, well before it.

Knows nothing about models, optimizers or what the ranks compute.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist

from leantrain.errors import LeantrainError

# What torchrun exports to every rank; `join` needs all of them.
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")

# Fragments of the messages gloo, NCCL and the TCP store raise when a peer is gone or late
# (gloo raises a bare RuntimeError: "Connection reset by peer", "Timed out waiting ...").
_PEER_FAILURES = ("connection", "timed out", "timeout", "socket", "peer")


T = TypeVar("T")


class RankError(RuntimeError):
    """A collective failed because a peer rank is missing, died or stalled past the timeout."""


@dataclass(frozen=True)
class World:
    """This process's place among the ranks.

    Attributes:
        rank: 0..size-1; rank 0 generates rollouts, logs, checkpoints and publishes weights.
        size: the number of ranks (1: no process group, nothing is communicated).
        device: this rank's device (`cuda:LOCAL_RANK` under NCCL).
        backend: "gloo", "nccl", or "none" for a single process.
        timeout_s: the limit on the rendezvous and on every collective.
    """

    rank: int
    size: int
    device: torch.device
    backend: str = "none"
    timeout_s: float = 300.0

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def single(device: torch.device) -> World:
    """The world of a run in one process: rank 0 of 1, no process group."""
    return World(0, 1, device)


def launched_by_torchrun() -> bool:
    """Whether this process is one rank of a torchrun-style launch of more than one process."""
    return all(k in os.environ for k in TORCHRUN_ENV) and int(os.environ["WORLD_SIZE"]) > 1


def join(device: torch.device, timeout_s: float) -> World:
    """Join the process group described by torchrun's environment (see `launched_by_torchrun`).

    `device` is the run's device type: CUDA ranks use NCCL, each on `cuda:LOCAL_RANK`; CPU ranks
    use gloo. Raises `RankError` when not every rank arrives within `timeout_s`.
    """
    missing = [k for k in TORCHRUN_ENV if k not in os.environ]
    if missing:
        raise LeantrainError(
            f"a distributed run needs torchrun's environment; {', '.join(missing)} not set "
            "(launch with `leantrain rl --nproc-per-node N` or `torchrun -m leantrain rl`)"
        )
    rank, size = _rank_and_size()
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    world = World(rank, size, device, backend, timeout_s)
    if not dist.is_initialized():
        where = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        with collective(world, f"joining the process group at {where}"):
            dist.init_process_group(
                backend,
                rank=rank,
                world_size=size,
                timeout=datetime.timedelta(seconds=timeout_s),
                device_id=device if backend == "nccl" else None,
            )
            # Every rank has arrived only once a first collective completes.
            dist.barrier()
    return world


def _rank_and_size() -> tuple[int, int]:
    """RANK and WORLD_SIZE from the environment; a LeantrainError names a bad one."""
    values = {}
    for key in ("RANK", "WORLD_SIZE"):
        try:
            values[key] = int(os.environ[key])
        except ValueError:
            raise LeantrainError(f"{key}={os.environ[key]!r} is not an integer") from None
    rank, size = values["RANK"], values["WORLD_SIZE"]
    if size < 1 or not 0 <= rank < size:
        raise LeantrainError(
            f"RANK={rank} with WORLD_SIZE={size}: a rank must be 0..WORLD_SIZE-1 and "
            "WORLD_SIZE at least 1"
        )
    return rank, size


def broadcast(world: World, obj: T) -> T:
    """Rank 0's `obj` (any picklable object) on every rank; the others pass anything (None).
    Raises `RankError` if a peer is gone."""
    payload = [obj]
    with collective(world, "a broadcast from rank 0"):
        dist.broadcast_object_list(payload, src=0)
    return payload[0]


def leave() -> None:
    """Destroy the process group, if this process joined one as a rank. A process group that
    other code made in a single-process run (an in-process vLLM engine makes a world of one)
    is not ours to destroy: that engine would hold dead groups and the next one would fail."""
    if launched_by_torchrun() and dist.is_initialized():
        dist.destroy_process_group()


@contextlib.contextmanager
def collective(world: World, what: str) -> Iterator[None]:
    """Turn a communication failure inside the block into a `RankError` that says which rank
    saw it, during what, and the likely cause; any other error passes through unchanged."""
    try:
        yield
    except RankError:
        raise
    except RuntimeError as e:  # gloo, NCCL and the store all raise RuntimeError subclasses
        message = str(e).strip()
        if not isinstance(e, dist.DistError) and not any(
            m in message.lower() for m in _PEER_FAILURES
        ):
            raise
        first = message.splitlines()[0] if message else type(e).__name__
        raise RankError(
            f"rank {world.rank} of {world.size}: {what} failed: a peer rank is missing, died or "
            f"did not answer within the {world.timeout_s:g} s timeout ({first})"
        ) from e
