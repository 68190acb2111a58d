"""The process backend of asynchronous RL: each rollout worker is a child process of this one,
spawned as a fresh interpreter, so it shares neither the trainer's GIL nor its OpenMP pool, and
no cluster daemons run beside it (the Ray backend's start-up costs several seconds of CPU).

Knows nothing about scheduling (rl/orchestrator.py does that). One pipe per child carries jobs
(and, in partial mode, weight offers) one way and results the other; a reader thread in this
process turns results into Futures. Weights go only to a child that was not sent their version
yet, as a state dict whose tensors torch's pickler moves into shared memory (no copy through the
pipe). In partial mode every published version is offered to every live child at once: a
receiving thread in the child takes jobs onto a queue and keeps the newest offered version in a
slot, which the batch running meanwhile reads between segments (its `newest`). A child that
exits fails its Futures; a stalled one is killed and replaced by the dispatcher.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import queue
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
    pipe closes. Messages are jobs (index, attempt, version, weights or None), weight offers
    ("offer", version, weights) and None, which ends the loop; a `_Receiver` thread reads them
    so an offer reaches a batch that is running."""
    torch.set_num_threads(threads)
    receiver = _Receiver(conn)
    try:
        worker = RolloutWorker(config, name, faults, slot)
    except Exception as e:  # reported to the parent, which replaces this worker
        conn.send(("error", e))
        return
    conn.send(("ready", None))
    newest = receiver.newest if config.orchestrator.mode == "partial" else None
    while (job := receiver.jobs.get()) is not None:
        try:
            conn.send(("done", worker.generate(*job, newest=newest)))
        except Exception as e:
            conn.send(("error", e))


def _receive(conn: Connection) -> Any:
    try:
        return conn.recv()
    except EOFError:  # the parent is gone
        return None


class _Receiver:
    """The child's reading end: a thread that puts jobs on `jobs` (None once the pipe closes)
    and keeps the newest version the parent sent (offered or with a job) for `newest`.

    A job comes without weights when the parent sent its version last (offered, or with an
    earlier job): it is given that version's weights here, in pipe order, because by the time
    the worker takes the job a newer offer may have replaced the slot."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.jobs: queue.Queue[tuple[int, int, int, Any] | None] = queue.Queue()
        self._lock = threading.Lock()
        self._newest: tuple[int, Any] | None = None
        self._last: tuple[int, Any] | None = None  # the weights sent last, whatever version
        threading.Thread(target=self._read, name="rollout-receiver", daemon=True).start()

    def newest(self) -> tuple[int, Any] | None:
        """(version, weights) of the newest version this child was sent, or None: the
        worker's `NewestWeights` in partial mode."""
        with self._lock:
            return self._newest

    def _read(self) -> None:
        try:
            while (message := _receive(self.conn)) is not None:
                if message[0] == "offer":
                    self._keep(message[1], message[2])
                    continue
                index, attempt, version, weights = message
                if weights is not None:
                    self._keep(version, weights)
                elif self._last is not None and self._last[0] == version:
                    weights = self._last[1]
                self.jobs.put((index, attempt, version, weights))
        finally:  # the child ends (and the parent sees it exit) rather than wait forever
            self.jobs.put(None)

    def _keep(self, version: int, weights: Any) -> None:
        with self._lock:
            self._last = (version, weights)
            if self._newest is None or version > self._newest[0]:
                self._newest = (version, weights)


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
        self.version = -1  # the version of the weights sent last
        self.dead = False
        self._lock = threading.Lock()
        # The dispatcher sends jobs and the trainer offers weights: one message at a time.
        self._send_lock = threading.Lock()
        threading.Thread(target=self._read, name=f"{name}-reader", daemon=True).start()

    def submit(self, index: int, attempt: int, weights: Published) -> cf.Future:
        """Send job (index, attempt) starting on `weights` (their payload only if this child
        was not sent their version last); a Future of its `RolloutBatch`."""
        future: cf.Future = cf.Future()
        with self._lock:
            if self.dead:
                future.set_exception(WorkerExited(f"{self.name} has exited"))
                return future
            self.pending.append(future)
        with self._send_lock:
            state = None if weights.version == self.version else weights.payload
            self._send((index, attempt, weights.version, state), weights.version)
        return future

    def offer(self, weights: Published) -> None:
        """Partial mode: send a newly published version for the batch running now (or the
        next), unless this child was sent it already."""
        with self._send_lock:
            if not self.dead and weights.version != self.version:
                self._send(("offer", weights.version, weights.payload), weights.version)

    def _send(self, message: tuple, version: int) -> None:
        try:
            self.conn.send(message)
        except OSError as e:  # the child is gone; the reader fails the Futures too
            self._fail(WorkerExited(f"{self.name} could not take a message ({e!r})"))
            return
        self.version = version

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
        return child.submit(index, attempt, weights)

    def publish(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v.cpu() for k, v in weights.items()}  # a no-op for CPU weights

    def offer(self, weights: Published) -> None:
        for child in list(self._children):  # a snapshot: the dispatcher replaces children
            if child is not None:
                child.offer(weights)

    def abandon(self, slot: int) -> None:
        child, self._children[slot] = self._children[slot], None
        if child is not None:
            child.kill()

    def shutdown(self) -> None:
        for slot, child in enumerate(self._children):
            if child is not None:
                child.close()
            self._children[slot] = None
