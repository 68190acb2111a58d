"""Where rollout workers and the trainer meet in asynchronous RL: the published weight versions
and the buffer of finished rollout batches. Both are thread-safe and every wait has a timeout.

Knows nothing about models, engines or Ray: a weight version is an opaque payload (a state dict
locally, an object-store reference on Ray), and a batch is a list of trajectories with its index.

Staleness is bounded by admission, not by dropping (dropping stale samples starves the long, hard
problems, tinker-cookbook PR #822): batch n (the one trained at step n) may START only on a
version published after step n - k, and the trainer takes batches strictly oldest first, so a
long batch is waited for, never skipped, and at most k + 1 batches are ever outstanding.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from leantrain.errors import LeantrainError
from leantrain.rl.trajectory import Trajectory


class StallError(LeantrainError):
    """A wait timed out: a rollout worker or the trainer stopped making progress."""


@dataclass
class RolloutBatch:
    """One step's rollouts, as a worker delivers them.

    Attributes:
        index: the training step this batch is for (its prompts are a function of it).
        trajectories: `group_size` responses per prompt, prompt-major.
        version: the policy version the batch started on (partial mode: its oldest token's).
        worker: name of the worker that generated it.
        attempt: 1 for the first try; a batch re-queued after a worker died counts up.
        generate_s: seconds the worker spent generating and scoring it.
        weight_sync_s: seconds the worker spent loading weights for it.
        events: the worker's own spans (idle, load, generate, score) since its last batch,
            for events.jsonl (telemetry/events.py); its sequences' ride on the trajectories.
    """

    index: int
    trajectories: list[Trajectory]
    version: int
    worker: str
    attempt: int = 1
    generate_s: float = 0.0
    weight_sync_s: float = 0.0
    events: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Published:
    """A weight version: after `step` optimizer steps the policy is `version`."""

    step: int
    version: int
    payload: Any
    at: float = field(default_factory=time.monotonic)


class WeightStore:
    """The newest `keep` published weight versions (k + 1 of them: every version a batch in
    flight may have started on)."""

    def __init__(self, keep: int) -> None:
        if keep < 1:
            raise ValueError(f"WeightStore.keep must be >= 1, got {keep}")
        self.keep = keep
        self._versions: list[Published] = []
        self._cond = threading.Condition()

    def publish(self, step: int, version: int, payload: Any) -> Published:
        """Make `payload` the newest version (returned); versions older than the newest `keep`
        are freed."""
        published = Published(step, version, payload)
        with self._cond:
            if self._versions and step <= self._versions[-1].step:
                raise ValueError(
                    f"published step {step} after step {self._versions[-1].step}: "
                    "steps must increase"
                )
            self._versions = [*self._versions, published][-self.keep :]
            self._cond.notify_all()
        return published

    def newest(self) -> Published | None:
        """The newest version, or None before the first publish."""
        with self._cond:
            return self._versions[-1] if self._versions else None

    def held(self) -> list[int]:
        """Versions held now, oldest first."""
        with self._cond:
            return [p.version for p in self._versions]

    def wait_for_step(self, step: int, timeout: float) -> Published | None:
        """The newest version once one from step >= `step` is published; None on timeout."""
        with self._cond:
            ready = self._cond.wait_for(
                lambda: bool(self._versions) and self._versions[-1].step >= step, timeout
            )
            return self._versions[-1] if ready else None


class BatchBuffer:
    """Finished rollout batches, handed to the trainer exactly once and oldest first.

    Bounded: batches `next_index` .. `next_index + capacity - 1` may be held; anything else is a
    scheduling bug and raises. A batch delivered twice (a worker declared dead that finishes
    after all, or a retried call) is rejected and counted in `duplicates`.
    """

    def __init__(self, capacity: int, next_index: int = 0) -> None:
        if capacity < 1:
            raise ValueError(f"BatchBuffer.capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.next_index = next_index  # the oldest batch not yet taken by the trainer
        self.duplicates = 0
        self._held: dict[int, RolloutBatch] = {}
        self._cond = threading.Condition()

    def put(self, batch: RolloutBatch) -> bool:
        """Admit `batch`; False (and counted) if it was delivered before."""
        with self._cond:
            if batch.index < self.next_index or batch.index in self._held:
                self.duplicates += 1
                return False
            if batch.index >= self.next_index + self.capacity:
                raise LeantrainError(
                    f"batch {batch.index} arrived while the trainer waits for batch "
                    f"{self.next_index}: more than {self.capacity} batches outstanding breaks "
                    "the staleness bound"
                )
            self._held[batch.index] = batch
            self._cond.notify_all()
            return True

    def __len__(self) -> int:
        with self._cond:
            return len(self._held)

    def get(
        self,
        timeout: float,
        check: Callable[[], None] = lambda: None,
        describe: Callable[[], str] = lambda: "",
    ) -> RolloutBatch:
        """Take the oldest batch, waiting at most `timeout` seconds for it to arrive.

        `check` runs a few times a second while waiting and may raise (the dispatcher's fatal
        error, so a dead rollout side stops the trainer at once); on timeout a `StallError`
        names the batch and adds `describe()` (what each worker is doing).
        """
        deadline = time.monotonic() + timeout
        with self._cond:
            while self.next_index not in self._held:
                check()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StallError(
                        f"trainer waited {timeout:.0f} s for rollout batch {self.next_index} "
                        f"and it never came; {describe()}"
                    )
                self._cond.wait(min(left, 0.1))
            batch = self._held.pop(self.next_index)
            self.next_index += 1
            return batch
