"""Launching a command on N local ranks under torchrun (`torch.distributed.run`), or a function
on N spawned local processes (`spawn_ranks`, for tests and benchmarks that start a process group
by hand).

`--standalone` gives torchrun a rendezvous on this machine on a free port it picks itself, so two
runs (or two test sessions) never collide on a fixed one. A rank that dies makes torchrun stop the
others and exit non-zero with the failed rank's number in its report.

Knows nothing about what the command trains.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any


def torchrun_command(processes: int, target: Sequence[str]) -> list[str]:
    """The command line that runs `target` (a script path and its arguments, or `-m module
    ...`) on `processes` local ranks, with this interpreter."""
    if processes < 1:
        raise ValueError(f"processes must be >= 1, got {processes}")
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={processes}",
        *target,
    ]


def run_torchrun(processes: int, target: Sequence[str]) -> int:
    """Run `target` on `processes` local ranks and wait; returns torchrun's exit code."""
    return subprocess.run(torchrun_command(processes, target), check=False).returncode


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now, for a process group's rendezvous
    (`MASTER_PORT`) started by hand; torchrun's `--standalone` picks its own. Another process
    may take it before the group binds it: a small race, acceptable for local runs and tests."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _as_rank(
    target: Callable[..., None], rank: int, processes: int, port: int, args: Sequence[Any]
) -> None:
    """A spawned rank's entry: torchrun's environment for `rank`, then `target(rank, *args)`."""
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(processes),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    target(rank, *args)


def spawn_ranks(
    target: Callable[..., None], args: Sequence[Any], timeout_s: float, processes: int = 2
) -> list[int | None]:
    """Run `target(rank, *args)` in `processes` spawned processes, each with torchrun's
    environment for its rank and one free rendezvous port (so `process_group.join` works in
    them as under torchrun), and wait up to `timeout_s` for them all; returns their exit codes
    (None for a process still running at the deadline, which is then killed: never a hang)."""
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [
        ctx.Process(target=_as_rank, args=(target, rank, processes, port, tuple(args)))
        for rank in range(processes)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(timeout=max(1.0, deadline - time.monotonic()))
    codes = [p.exitcode for p in procs]
    for p in procs:
        if p.is_alive():
            p.kill()
    return codes
