"""Launching a command on N local ranks under torchrun (`torch.distributed.run`).

`--standalone` gives torchrun a rendezvous on this machine on a free port it picks itself, so two
runs (or two test sessions) never collide on a fixed one. A rank that dies makes torchrun stop the
others and exit non-zero with the failed rank's number in its report.

Knows nothing about what the command trains.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Sequence


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
