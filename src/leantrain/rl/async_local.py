"""The local backend of asynchronous RL: rollout workers are threads of this process, each with
its own policy copy; weights are published as detached state-dict snapshots.

Knows nothing about scheduling (rl/orchestrator.py does that). A job runs in a fresh daemon thread
so a stalled worker can be abandoned without blocking the process's exit; its late result goes to
a Future nobody reads any more, and the buffer would reject it anyway.

On 2 CPU cores the trainer and one worker thread overlap: torch kernels release the GIL, so a
rollout forward and a training backward do run side by side, one intra-op thread each.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
from typing import Any

import torch

from leantrain.rl.buffer import Published, WeightStore
from leantrain.rl.config import RLConfig
from leantrain.rl.rollout_worker import FaultPlan, RolloutWorker


class LocalBackend:
    """`workers` rollout workers as threads (none in a synchronous run); see
    `orchestrator.WorkerPool` for the interface."""

    def __init__(
        self, config: RLConfig, store: WeightStore, faults: FaultPlan | None, workers: int
    ) -> None:
        self.config = config
        self.store = store
        self.faults = faults
        self.workers = workers
        self._slots: list[RolloutWorker | None] = [None] * self.workers
        self._generation = 0  # counts replacements, to name workers apart

    def start(self, slot: int) -> None:
        self._generation += 1
        self._slots[slot] = RolloutWorker(
            self.config, name=f"worker-{slot}.{self._generation}", faults=self.faults, slot=slot
        )

    def ready(self, slot: int) -> bool:
        return self._slots[slot] is not None  # a thread's worker is built by start()

    def submit(self, slot: int, index: int, attempt: int, weights: Published) -> cf.Future:
        worker = self._slots[slot]
        if worker is None:
            raise RuntimeError(f"rollout slot {slot} has no worker; start() it first")
        future: cf.Future = cf.Future()
        newest = self._newest if self.config.orchestrator.mode == "partial" else None

        def job() -> None:
            try:
                future.set_result(
                    worker.generate(index, attempt, weights.version, weights.payload, newest)
                )
            except BaseException as e:  # delivered to the dispatcher, which replaces the worker
                future.set_exception(e)

        threading.Thread(target=job, name=f"{worker.name}-batch-{index}", daemon=True).start()
        return future

    def _newest(self) -> tuple[int, Any] | None:
        latest = self.store.newest()
        return None if latest is None else (latest.version, latest.payload)

    def publish(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return weights  # threads load the learner's snapshot as it is

    def offer(self, weights: Published) -> None:
        pass  # a thread's `newest` reads the store itself

    def abandon(self, slot: int) -> None:
        self._slots[slot] = None  # its thread, if still running, finishes into the void

    def shutdown(self) -> None:
        self._slots = [None] * self.workers
