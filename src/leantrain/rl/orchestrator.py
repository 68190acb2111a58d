"""The one RL loop, for every `orchestrator.mode`: batch n comes out of the buffer, the learner
trains on it, the new weights are published, the step is logged. Synchronous is the case with no
workers and staleness 0: the trainer generates every batch itself, on the weights it is about to
train. Asynchronous (DORA-style), rollout workers generate later steps' batches while the trainer
trains, under three guarantees (arXiv 2604.26256):

1. intra-trajectory consistency: in `async` mode a batch is generated on the one version it
   started on, so every token of a trajectory carries the same version (`partial` mode trades
   this for freshness: in-flight sequences resume on new weights, per-token versions recorded);
2. data integrity: every batch reaches the trainer exactly once, oldest first; a worker that
   dies or stalls has its batch re-queued and a late duplicate is rejected (rl/buffer.py);
3. bounded staleness: batch n starts only on weights published after step n - k, so the trainer
   never trains on a policy more than k versions old. Async with k = 0 is the synchronous run,
   trajectory for trajectory.

Two threads of control: the trainer (the caller's thread, `AsyncOrchestrator.step`) and the
dispatcher (a thread that hands batch indices to free workers, collects results, and watches
every wait against `timeout_s`). Workers are threads (rl/async_local.py), spawned processes
(rl/async_process.py) or Ray actors (rl/ray_backend.py) behind one small `WorkerPool` interface;
weights travel as state dicts or object-store references, tagged with their version. In
`partial` mode each publish is also offered to the workers at once (`WorkerPool.offer`), so a
batch in flight on any of them sees it.

When the trainer needs a batch that no worker has started and no ready worker is free to start
(every batch of a synchronous run; at the start of an async one, while worker processes or actors
boot), it generates that batch itself on its current weights instead of waiting: its own
`RolloutSource` shares the learner's weights, so it needs no publish, unless its backend samples
from a copy of its own (vLLM), which then gets every version like a worker. On vLLM servers
(`rollout.backend: vllm_server`) the workers hold the servers while they run, each its own share
(rl/rollout.py `vllm_server_backend`): the trainer's client, on the same servers, then neither
generates nor publishes (it would change a worker's weights under its batch); the trainer waits
for the workers' batches, and its client gets the last version once they stop, for what the run
does after (the final evaluation).

Knows nothing about losses or engines: it is handed the `Learner` (rl/learner.py), the trainer's
own `RolloutSource` (rl/rollout.py) for the batches it generates itself, and a callback that logs
a finished step; a worker is a `RolloutWorker` (rl/rollout_worker.py).
"""

from __future__ import annotations

import bisect
import concurrent.futures as cf
import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Protocol

import numpy as np
import torch

from leantrain.errors import LeantrainError
from leantrain.rl.buffer import BatchBuffer, Published, RolloutBatch, StallError, WeightStore
from leantrain.rl.config import RLConfig
from leantrain.rl.learner import Learner
from leantrain.rl.rollout import RolloutSource
from leantrain.rl.rollout_worker import FaultPlan
from leantrain.rl.trajectory import Trajectory
from leantrain.telemetry.events import EventLog, SpanTrack

log = logging.getLogger(__name__)


class LogStep(Protocol):
    """Appends a finished step's record (its trajectories, the learner's stats, timings and
    `extra` fields) to the run's metrics; returns the record."""

    def __call__(
        self,
        trajectories: list[Trajectory],
        stats: dict[str, float],
        gen_s: float,
        train_s: float,
        idle_s: float,
        **extra: float | int | str,
    ) -> dict[str, Any]: ...


class WorkerPool(Protocol):
    """Where rollout workers live: threads, processes or Ray actors (`orchestrator.backend`).
    Slots 0..workers-1 each hold one worker at a time."""

    workers: int

    def start(self, slot: int) -> None:
        """Create (or replace) the worker in `slot`; it may still be starting on return."""

    def ready(self, slot: int) -> bool:
        """Whether `slot`'s worker has started and can take a batch without queueing."""

    def submit(self, slot: int, index: int, attempt: int, weights: Published) -> cf.Future:
        """Generate batch `index` on `slot`'s worker, starting on `weights`; a Future of a
        `RolloutBatch` that raises if the worker dies."""

    def publish(self, weights: dict[str, torch.Tensor]) -> Any:
        """The learner's weight snapshot as workers load it (the store's payload): as it is in
        this process, on the CPU for another one, a reference in Ray's object store."""

    def offer(self, weights: Published) -> None:
        """Partial mode: hand a newly published version to every live worker, so a batch in
        flight switches to it at its next segment (threads read the store instead)."""

    def abandon(self, slot: int) -> None:
        """Give up on `slot`'s worker (dead or stalled); its late result is ignored."""

    def shutdown(self) -> None:
        """Stop every worker."""


@dataclass
class _Job:
    index: int
    attempt: int
    version: int
    started: float
    future: cf.Future


@dataclass
class _Activity:
    """What the trainer is doing, for stall reports."""

    doing: str
    since: float
    busy: bool  # True while training or publishing (a stall there is the trainer's)


class Dispatcher:
    """Hands batches `first`..`last - 1` to free workers in order, as admission allows, and puts
    their results in the buffer. Runs in its own thread; a fatal error is kept in `error` and
    raised in the trainer by `check()`."""

    def __init__(
        self,
        pool: WorkerPool,
        store: WeightStore,
        buffer: BatchBuffer,
        *,
        first: int,
        last: int,
        max_staleness: int,
        timeout_s: float,
        max_restarts: int,
        trainer: _Activity,
        inline: bool = True,
    ) -> None:
        self.pool = pool
        self.inline = inline  # whether the trainer may claim a batch to generate itself
        self.store = store
        self.buffer = buffer
        self.todo = list(range(first, last))  # sorted: re-queued batches go back in order
        self.k = max_staleness
        self.timeout_s = timeout_s
        self.max_restarts = max_restarts
        self.trainer = trainer
        self.running: dict[int, _Job] = {}
        self.attempts: Counter[int] = Counter()
        self.restarts = 0
        self.busy_s = 0.0  # worker-seconds spent on jobs, delivered or not
        self.error: BaseException | None = None
        # Guards `todo`, `running` and `attempts` between this thread and a claiming trainer.
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="rollout-dispatcher", daemon=True)

    def start(self) -> None:
        if self.pool.workers:  # with none, the trainer claims every batch itself
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.timeout_s)

    def check(self) -> None:
        """Raise the dispatcher's fatal error, if any (called by the waiting trainer)."""
        if self.error is not None:
            raise self.error

    def claim(self, index: int) -> int | None:
        """Hand batch `index` to the trainer to generate itself, if it is the next to start and
        no free worker is ready to start it; returns its attempt number, or None."""
        with self._lock:
            if not self.inline or not self.todo or self.todo[0] != index:
                return None
            idle = [slot for slot in range(self.pool.workers) if slot not in self.running]
            if any(map(self.pool.ready, idle)):
                return None
            self.todo.pop(0)
            self.attempts[index] += 1
            return self.attempts[index]

    def describe(self) -> str:
        """What every worker and the trainer are doing now, for stall reports."""
        now = time.monotonic()
        jobs = [
            f"worker {slot} generating batch {j.index} (attempt {j.attempt}) on version "
            f"{j.version} for {now - j.started:.1f} s"
            # A snapshot: the dispatcher thread changes `running` meanwhile.
            for slot, j in sorted(list(self.running.items()))
        ]
        idle = self.pool.workers - len(self.running)
        parts = jobs + ([f"{idle} worker(s) idle"] if idle else [])
        parts.append(f"trainer {self.trainer.doing} for {now - self.trainer.since:.1f} s")
        if self.todo:
            parts.append(
                f"next batch {self.todo[0]} waits for weights of step {self.todo[0] - self.k}"
            )
        return "; ".join(parts)

    def _loop(self) -> None:
        try:
            free = list(range(self.pool.workers))
            waiting_since: float | None = None
            while not self._stop.is_set() and (self.todo or self.running):
                with self._lock:
                    waiting_since = self._admit(free, waiting_since)
                    futures = [j.future for j in self.running.values()]
                if futures:
                    cf.wait(futures, timeout=0.05, return_when=cf.FIRST_COMPLETED)
                elif self.todo and any(map(self.pool.ready, free)):
                    self.store.wait_for_step(self.todo[0] - self.k, timeout=0.05)
                else:
                    self._stop.wait(0.05)  # every worker is still starting
                with self._lock:
                    self._collect(free)
        except BaseException as e:  # kept for the trainer: a dead dispatcher must not hang it
            log.error("rollout dispatcher stopped: %s", e)
            self.error = e

    def _admit(self, free: list[int], waiting_since: float | None) -> float | None:
        """Start the next batches on free, ready workers while admission allows; returns since
        when the next batch has waited for weights (None if it is not waiting)."""
        while self.todo and (ready := [slot for slot in free if self.pool.ready(slot)]):
            index = self.todo[0]
            weights = self.store.newest()
            if weights is None or weights.step < index - self.k:
                now = time.monotonic()
                if waiting_since is None:
                    return now
                if self.trainer.busy and now - self.trainer.since > self.timeout_s:
                    raise StallError(
                        f"trainer stalled: {self.trainer.doing} for {now - self.trainer.since:.0f}"
                        f" s (timeout {self.timeout_s:.0f} s); batch {index} waits for the "
                        f"weights of step {index - self.k}"
                    )
                return waiting_since
            slot = ready[0]
            free.remove(slot)
            self.todo.pop(0)
            self.attempts[index] += 1
            future = self.pool.submit(slot, index, self.attempts[index], weights)
            self.running[slot] = _Job(
                index, self.attempts[index], weights.version, time.monotonic(), future
            )
        return None

    def _collect(self, free: list[int]) -> None:
        """Deliver finished jobs; replace workers that died or ran past the timeout."""
        now = time.monotonic()
        for slot, job in list(self.running.items()):
            if job.future.done():
                error = job.future.exception()
                problem = None if error is None else f"died on batch {job.index} ({error!r})"
            elif now - job.started > self.timeout_s:
                problem = (
                    f"stalled: generating batch {job.index} (attempt {job.attempt}) on version "
                    f"{job.version} for {now - job.started:.0f} s (timeout {self.timeout_s:.0f} s)"
                )
            else:
                continue
            del self.running[slot]
            self.busy_s += now - job.started
            free.append(slot)
            if problem is None:
                self.buffer.put(job.future.result())
                continue
            self.restarts += 1
            if self.restarts > self.max_restarts:
                raise LeantrainError(
                    f"rollout worker {slot} {problem}; giving up after {self.max_restarts} "
                    "worker restarts (orchestrator.max_restarts)"
                )
            log.error("rollout worker %d %s; replacing it and re-queuing the batch", slot, problem)
            self.pool.abandon(slot)
            self.pool.start(slot)
            bisect.insort(self.todo, job.index)


class Orchestrator:
    """Drives a run in any mode: a context manager that starts and stops the workers (none in
    sync mode), and `step()`, one learner step on the oldest finished batch.

    Args:
        config: the run config (its `orchestrator` section, steps, and what workers build).
        learner: trains on the batches and publishes each new version; its step and version say
            where to start (a resumed run continues).
        source: the trainer's own rollout path, for batches no worker can start (every batch of
            a synchronous run).
        log_step: appends each finished step to the run's metrics.
        faults: faults to inject into the workers, for tests.
        events: where each batch's sequence and worker spans and the trainer's own spans
            (`publish`, `generate`, `wait`, `train`, `log`: they tile its time) are written;
            None records nothing.

    Attributes:
        generate_s: seconds spent generating batches (workers' time overlaps training).
        train_s: seconds the learner spent training.
    """

    def __init__(
        self,
        config: RLConfig,
        learner: Learner,
        source: RolloutSource,
        log_step: LogStep,
        faults: FaultPlan | None = None,
        events: EventLog | None = None,
    ) -> None:
        self.config = config
        self.events = events
        self.track = SpanTrack("trainer", "start")
        self.learner = learner
        self.source = source
        self.log_step = log_step
        self.cfg = config.orchestrator
        sync = self.cfg.mode == "sync"
        # Stale samples need a correction; a synchronous batch is on-policy by construction.
        self.correction = "none" if sync else self.cfg.off_policy
        k = 0 if sync else self.cfg.max_staleness
        self.store = WeightStore(keep=k + 1)
        self.buffer = BatchBuffer(capacity=k + 1, next_index=learner.steps)
        self.trainer = _Activity("starting", time.monotonic(), busy=False)
        self.pool = self._make_pool(0 if sync else self.cfg.rollout_workers, faults)
        # The workers hold the trainer's servers while they run (module doc).
        self.lent = config.rollout.backend == "vllm_server" and self.pool.workers > 0
        self.dispatcher = Dispatcher(
            self.pool,
            self.store,
            self.buffer,
            first=learner.steps,
            last=config.steps,
            max_staleness=k,
            timeout_s=self.cfg.timeout_s,
            max_restarts=self.cfg.max_restarts,
            trainer=self.trainer,
            inline=not self.lent,
        )
        self.max_staleness_seen = 0
        self.generate_s = 0.0
        self.train_s = 0.0
        self.weight_sync_s: list[float] = []
        self.wait_s = 0.0  # trainer time spent waiting for batches
        self.generation_idle = 0.0  # as of the last step
        self._threads_before = torch.get_num_threads()
        self._start = time.monotonic()

    def _trainer_threads(self) -> int:
        """The trainer's torch threads. Locally torch's thread count is per process, so the
        trainer and each worker thread all get an even share; worker processes and actors of a
        local Ray take `rollout_threads` each (1 by default) off the machine; a cluster's actors
        take none; with no workers the trainer keeps every thread."""
        workers, total = self.pool.workers, self._threads_before
        if workers == 0:
            return total
        if self.cfg.backend == "local":
            return max(1, self.cfg.rollout_threads or total // (workers + 1))
        if self.cfg.ray_address is None:
            return max(1, total - workers * (self.cfg.rollout_threads or 1))
        return total

    def _make_pool(self, workers: int, faults: FaultPlan | None) -> WorkerPool:
        if workers and self.cfg.backend == "ray":
            from leantrain.rl.ray_backend import RayBackend

            return RayBackend(self.config, faults)
        if workers and self.cfg.backend == "process":
            from leantrain.rl.async_process import ProcessBackend

            return ProcessBackend(self.config, faults)
        from leantrain.rl.async_local import LocalBackend

        return LocalBackend(self.config, self.store, faults, workers)

    def __enter__(self) -> Orchestrator:
        torch.set_num_threads(self._trainer_threads())
        for slot in range(self.pool.workers):
            self.pool.start(slot)
        self.track.enter("publish", version=self.learner.version)
        self._publish()
        self.track.enter("log")
        self._start = time.monotonic()
        self.dispatcher.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.dispatcher.stop()
        self.pool.shutdown()
        if self.lent and exc_type is None:  # the servers are the trainer's again
            self.source.backend.load_weights(self.learner.publish(), self.learner.version)
        torch.set_num_threads(self._threads_before)
        if self.events is not None:
            self.events.write(self.track.close())

    def _publish(self) -> float:
        """Publish the trainer's weights as (step, version); returns seconds. Workers need a
        copy, and so does the trainer's own source when its backend samples from weights of
        its own (vLLM: `separate_weights`) and the workers do not hold it (`lent`); the native
        engine samples on the learner's."""
        t0 = time.perf_counter()
        separate = self.source.backend.capabilities.separate_weights and not self.lent
        weights = self.learner.publish() if self.pool.workers or separate else None
        payload = self.pool.publish(weights) if self.pool.workers else None
        if separate:
            self.source.backend.load_weights(weights, self.learner.version)
        published = self.store.publish(self.learner.steps, self.learner.version, payload)
        if self.pool.workers and self.cfg.mode == "partial":
            self.pool.offer(published)
        return time.perf_counter() - t0

    def _doing(self, what: str, busy: bool, span: str, **attrs: Any) -> None:
        """The trainer starts `what` (for stall reports), its `span` in events.jsonl."""
        self.trainer.doing, self.trainer.since, self.trainer.busy = what, time.monotonic(), busy
        self.track.enter(span, **attrs)

    def step(self) -> dict[str, Any]:
        """Train on the oldest batch (waiting for it if need be), publish the new weights, log."""
        learner = self.learner
        t0 = time.perf_counter()
        inline_s = self._generate_inline(learner.steps)
        self._doing(
            f"waiting for batch {learner.steps}", busy=False, span="wait", batch=learner.steps
        )
        # The dispatcher replaces a dead or stalled worker within timeout_s, at most
        # max_restarts times; past that budget the trainer stops waiting.
        batch: RolloutBatch = self.buffer.get(
            timeout=self.cfg.timeout_s * (self.cfg.max_restarts + 2),
            check=self.dispatcher.check,
            describe=self.dispatcher.describe,
        )
        wait_s = time.perf_counter() - t0 - inline_s
        self.wait_s += wait_s
        staleness = [
            learner.version - min(t.versions, default=learner.version) for t in batch.trajectories
        ]
        self._doing(
            f"training step {learner.steps + 1}", busy=True, span="train", batch=batch.index
        )
        t1 = time.perf_counter()
        stats = learner.step(batch.trajectories, correction=self.correction, is_cap=self.cfg.is_cap)
        train_s = time.perf_counter() - t1
        self._doing(
            f"publishing the weights of step {learner.steps}",
            busy=True,
            span="publish",
            version=learner.version,
        )
        publish_s = self._publish()
        self._doing("logging", busy=False, span="log")
        if self.events is not None:
            self.events.write(
                [*self.track.drain(), *batch.events],
                batch.trajectories,
                track=batch.worker,
                batch=batch.index,
            )
        self.max_staleness_seen = max(self.max_staleness_seen, *staleness)
        self.weight_sync_s.append(publish_s + batch.weight_sync_s)
        self.generation_idle = self._generation_idle()
        self.generate_s += batch.generate_s
        self.train_s += train_s
        mixed = sum(len(set(t.versions)) > 1 for t in batch.trajectories)
        return self.log_step(
            batch.trajectories,
            stats,
            gen_s=batch.generate_s,
            train_s=train_s,
            idle_s=wait_s,
            staleness_max=max(staleness),
            staleness_mean=float(np.mean(staleness)),
            mixed_version_trajectories=mixed,
            batch_version=batch.version,
            batch_attempt=batch.attempt,
            batch_worker=batch.worker,
            weight_publish_s=round(publish_s, 4),
            weight_load_s=round(batch.weight_sync_s, 4),
            weight_sync_s=round(publish_s + batch.weight_sync_s, 4),
            versions_held=len(self.store.held()),
            worker_restarts=self.dispatcher.restarts,
            duplicates_rejected=self.buffer.duplicates,
            generation_idle_fraction=round(self.generation_idle, 4),
        )

    def _generate_inline(self, index: int) -> float:
        """Generate batch `index` on the trainer's weights when no worker can start it now;
        returns the seconds it took (0 if a worker has it). The batch goes through the buffer
        like any other, so exactly-once delivery is checked in one place."""
        attempt = self.dispatcher.claim(index)
        if attempt is None:
            return 0.0
        self._doing(
            f"generating batch {index} itself (no worker ready)",
            busy=True,
            span="generate",
            batch=index,
            version=self.learner.version,
        )
        t0 = time.perf_counter()
        trajectories = self.source.rollout(index, self.learner.version)
        seconds = time.perf_counter() - t0
        self.buffer.put(
            RolloutBatch(index, trajectories, self.learner.version, "trainer", attempt, seconds, 0)
        )
        return seconds

    def _generation_idle(self) -> float:
        """Share of worker time (workers x seconds since start) not spent on a batch."""
        elapsed = (time.monotonic() - self._start) * self.pool.workers
        jobs = list(self.dispatcher.running.values())  # a snapshot, as in `describe`
        running = sum(time.monotonic() - j.started for j in jobs)
        return max(0.0, 1.0 - (self.dispatcher.busy_s + running) / max(elapsed, 1e-9))

    def summary(self) -> dict[str, Any]:
        """The async fields of the run summary (none for a synchronous run). Async
        `seconds_generating` is worker time, which overlaps training; `seconds_idle` is the
        trainer's time waiting for batches."""
        if self.cfg.mode == "sync":
            return {}
        return {
            "mode": self.cfg.mode,
            "backend": self.cfg.backend,
            "max_staleness": self.cfg.max_staleness,
            "max_observed_staleness": self.max_staleness_seen,
            "seconds_idle": round(self.wait_s, 2),
            "generation_idle_fraction": round(self.generation_idle, 4),
            "weight_sync_s_mean": round(float(np.mean(self.weight_sync_s)), 4)
            if self.weight_sync_s
            else 0.0,
            "worker_restarts": self.dispatcher.restarts,
            "duplicates_rejected": self.buffer.duplicates,
            # ray: worker name -> the Ray node it ran on (where `ray_rollout_resource` put it)
            **({"rollout_nodes": dict(self.pool.nodes)} if self.cfg.backend == "ray" else {}),
        }
