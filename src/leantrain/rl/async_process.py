"""The process backend of asynchronous RL: each rollout worker is a child process of this one,
spawned as a fresh interpreter, so it shares neither the trainer's GIL nor its OpenMP pool, and
no cluster daemons run beside it (the Ray backend's start-up costs several seconds of CPU).

Knows nothing about scheduling (rl/orchestrator.py does that). One pipe per child carries jobs
one way and results the other; a reader thread in this process turns results into Futures.
Weights go only to a child that does not hold their version yet, as a state dict whose tensors
torch's pickler moves into shared memory (no copy through the pipe). A child that exits fails
its Futures; a stalled one is killed and replaced by the dispatcher.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import threading
from collections import deque
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.multiprocessing as mp

from leantrain.rl.buffer import Published
from leantrain.rl.config import RLConfig
from leantrain.rl.rollout_worker import FaultPlan, RolloutWorker


class WorkerExited(RuntimeError):
    """A rollout process ended while it held a job, or before it was ready."""


def _serve(
    conn: Connection,
    config: RLConfig,
    name: str,
    slot: int,
    threads: int,
    faults: FaultPlan | None,
) -> None:
    """The child's main loop: build a `RolloutWorker`, say ready, then answer jobs until the
    pipe closes. A job is (index, attempt, version, weights or None); None ends the loop."""
    torch.set_num_threads(threads)
    try:
        worker = RolloutWorker(config, name, faults, slot)
    except Exception as e:  # reported to the parent, which replaces this worker
        conn.send(("error", e))
        return
    conn.send(("ready", None))
    while (job := _receive(conn)) is not None:
        try:
            conn.send(("done", worker.generate(*job)))
        except Exception as e:
            conn.send(("error", e))


def _receive(conn: Connection) -> Any:
    try:
        return conn.recv()
    except EOFError:  # the parent is gone
        return None


class _Child:
    """One rollout process, its pipe, and the Futures of the jobs it holds (in order)."""

    def __init__(
        self, config: RLConfig, name: str, slot: int, threads: int, faults: FaultPlan | None
    ) -> None:
        ctx = mp.get_context("spawn")
        self.name = name
        self.conn, child_end = ctx.Pipe()
        self.process = ctx.Process(
            target=_serve,
            args=(child_end, config, name, slot, threads, faults),
            name=name,
            daemon=True,
        )
        self.process.start()
        child_end.close()
        self.ready: cf.Future = cf.Future()
        self.pending: deque[cf.Future] = deque()
        self.version = -1  # the last version sent
        self.dead = False
        self._lock = threading.Lock()
        threading.Thread(target=self._read, name=f"{name}-reader", daemon=True).start()

    def submit(self, job: tuple[int, int, int, Any]) -> cf.Future:
        future: cf.Future = cf.Future()
        with self._lock:
            if self.dead:
                future.set_exception(WorkerExited(f"{self.name} has exited"))
                return future
            self.pending.append(future)
        try:
            self.conn.send(job)
        except OSError as e:  # the child is gone; the reader fails the Future too
            self._fail(WorkerExited(f"{self.name} could not take a job ({e!r})"))
        return future

    def _read(self) -> None:
        while True:
            try:
                kind, value = self.conn.recv()
            except (EOFError, OSError):
                self.process.join(timeout=1.0)
                code = self.process.exitcode
                self._fail(WorkerExited(f"{self.name} exited (exit code {code})"))
                return
            if kind == "ready":
                self.ready.set_result(None)
                continue
            with self._lock:
                future = self.pending.popleft() if self.ready.done() else self.ready
            if kind == "done":
                future.set_result(value)
            else:
                future.set_exception(value)

    def _fail(self, error: BaseException) -> None:
        with self._lock:
            self.dead = True
            waiting = list(self.pending) + ([] if self.ready.done() else [self.ready])
            self.pending.clear()
        for future in waiting:
            if not future.done():
                future.set_exception(error)

    def kill(self) -> None:
        self.process.kill()
        self.conn.close()

    def close(self) -> None:
        with contextlib.suppress(OSError):  # already gone
            self.conn.send(None)
        self.process.join(timeout=5.0)
        if self.process.is_alive():
            self.kill()


class ProcessBackend:
    """Rollout workers as spawned processes; see `orchestrator.WorkerPool` for the interface."""

    def __init__(self, config: RLConfig, faults: FaultPlan | None) -> None:
        self.config = config
        self.faults = faults
        self.workers = config.orchestrator.rollout_workers
        self.threads = config.orchestrator.rollout_threads or 1
        self._children: list[_Child | None] = [None] * self.workers
        self._generation = 0

    def start(self, slot: int) -> None:
        self._generation += 1
        name = f"process-worker-{slot}.{self._generation}"
        self._children[slot] = _Child(self.config, name, slot, self.threads, self.faults)

    def ready(self, slot: int) -> bool:
        child = self._children[slot]
        return child is not None and child.ready.done()

    def submit(self, slot: int, index: int, attempt: int, weights: Published) -> cf.Future:
        child = self._children[slot]
        if child is None:
            raise RuntimeError(f"rollout slot {slot} has no worker; start() it first")
        state = None if weights.version == child.version else weights.payload
        child.version = weights.version
        return child.submit((index, attempt, weights.version, state))

    def publish(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v.cpu() for k, v in weights.items()}  # a no-op for CPU weights

    def abandon(self, slot: int) -> None:
        child, self._children[slot] = self._children[slot], None
        if child is not None:
            child.kill()

    def shutdown(self) -> None:
        for slot, child in enumerate(self._children):
            if child is not None:
                child.close()
            self._children[slot] = None
