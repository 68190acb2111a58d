"""How many torch threads a leantrain command takes: its share of the cores it may use among the
leantrain commands running on this machine, followed while it runs.

Torch gives every process one intra-op thread per core, and OpenMP threads spin while they wait
for each other; two processes that each hold every core then run several times slower
(`benchmarks/two_processes.py`). So each command registers in `$LEANTRAIN_HOME/processes/`
(one file per process, removed at exit; a file whose process is gone is ignored and removed)
and takes `usable cores // live commands` threads, at least one. The training loops call
`follow_share()` once a step: when a command starts or ends beside this one, the share moves
at the next step. A count given by the user (`--threads`) is kept as given; a count that some
other code set in between (the async orchestrator's split between trainer and workers) is left
alone until it is back at the value the share set.

Only processes that called `claim_threads` register or follow: the library used from Python
keeps torch's own setting.
"""

from __future__ import annotations

import atexit
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from leantrain.errors import LeantrainError
from leantrain.settings import leantrain_home

# How often `follow_share` reads the register at most: a step can take microseconds.
_FOLLOW_EVERY_S = 1.0


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity: taskset, a container's cpuset),
    not the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def _start_time(pid: int) -> str | None:
    """A token that tells a process from a later one given the same pid (Linux: its start
    time in clock ticks since boot); None when `pid` does not run."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except FileNotFoundError:
        return None
    except OSError:  # no /proc: the pid alone, when it runs
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return str(pid)


def live_processes(register: Path) -> list[int]:
    """Pids of the registered processes still running; files of finished ones are removed."""
    live = []
    for entry in register.glob("*"):
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        try:
            token = entry.read_text()
        except FileNotFoundError:  # removed by its process meanwhile
            continue
        if _start_time(pid) == token:
            live.append(pid)
        else:
            entry.unlink(missing_ok=True)
    return sorted(live)


def fair_share(cores: int, processes: int) -> int:
    """Threads for one of `processes` commands on `cores` cores: an equal share, at least 1."""
    return max(1, cores // max(1, processes))


@dataclass
class _Claim:
    """This process's registration: where, what the user pinned, what the share last set."""

    register: Path
    pinned: int | None
    last_set: int
    checked_at: float


_claim: _Claim | None = None


def claim_threads(threads: int | None = None, register: Path | None = None) -> int:
    """Register this process and set torch's intra-op threads: `threads` when given (kept for
    the whole run), else the fair share of the usable cores among the live commands (followed
    by `follow_share`). `OMP_NUM_THREADS` in the environment counts as given. Returns the
    count set. A later call keeps the registration and replaces the pin."""
    global _claim
    if threads is not None and threads < 1:
        raise LeantrainError(f"--threads must be at least 1 (got {threads})")
    if threads is None and os.environ.get("OMP_NUM_THREADS", "").isdigit():
        threads = max(1, int(os.environ["OMP_NUM_THREADS"]))
    if _claim is None:
        folder = register or leantrain_home() / "processes"
        folder.mkdir(parents=True, exist_ok=True)
        entry = folder / str(os.getpid())
        entry.write_text(_start_time(os.getpid()) or str(os.getpid()))
        atexit.register(entry.unlink, missing_ok=True)
        _claim = _Claim(folder, threads, 0, 0.0)
    _claim.pinned = threads
    count = threads or fair_share(usable_cores(), len(live_processes(_claim.register)))
    torch.set_num_threads(count)
    _claim.last_set, _claim.checked_at = count, time.monotonic()
    return count


def follow_share() -> None:
    """Once a step: move this process's threads to its fair share when commands started or
    ended beside it. Does nothing unless `claim_threads` ran without a pin, or when other code
    changed the count since the share set it."""
    claim = _claim
    if claim is None or claim.pinned is not None:
        return
    now = time.monotonic()
    if now - claim.checked_at < _FOLLOW_EVERY_S or torch.get_num_threads() != claim.last_set:
        return
    claim.checked_at = now
    count = fair_share(usable_cores(), len(live_processes(claim.register)))
    if count != claim.last_set:
        torch.set_num_threads(count)
        claim.last_set = count
