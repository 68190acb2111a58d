"""The Ray backend of asynchronous RL (the learner group placed on a Ray cluster is
rl/ray_placement.py).

Each rollout worker is a Ray actor (its own process, so no GIL is shared with the trainer), and
weights are published once per step into the object store with their version; a worker fetches a
version only when it does not hold it already.

Knows nothing about scheduling (rl/orchestrator.py does that). `ray.init` starts a local Ray on
this machine unless `orchestrator.ray_address` names a cluster; a Ray already initialised by the
caller (or the learner actor this runs in) is used as it is. With
`orchestrator.ray_rollout_resource` the actors go only to nodes that offer that custom resource
(`ray start --resources`). Every call on an actor is a Future the dispatcher waits on with its
timeout; a dead actor (its process gone) surfaces as that Future's exception, a `WorkerExited`
that names the worker, and a stalled one is killed with `ray.kill` and replaced.

In partial mode the actor is threaded (`max_concurrency` 2): while `generate` runs on one
thread, `offer` takes each newly published version (its object-store reference, put once for
every actor) on the other and keeps the newest in a slot, which the batch reads between segments
(its `newest`).

With `rollout.backend: vllm` each actor holds its own in-process vLLM engine, as a `process`
worker does (rl/rollout_worker.py builds it), and loads each published version between batches
(between segments in partial mode).
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
from typing import Any

import torch

from leantrain.distributed.ray_group import SHARE, check_resource, connect, import_ray
from leantrain.rl.async_process import WorkerExited
from leantrain.rl.buffer import Published
from leantrain.rl.config import RLConfig
from leantrain.rl.rollout_worker import FaultPlan, RolloutWorker


class _Actor:
    """The body of a rollout actor: a `RolloutWorker` in a process of its own."""

    def __init__(
        self, config: RLConfig, name: str, slot: int, threads: int, faults: FaultPlan | None
    ) -> None:
        torch.set_num_threads(threads)
        self.worker = RolloutWorker(config, name, faults, slot)
        self.timeout_s = config.orchestrator.timeout_s
        self.partial = config.orchestrator.mode == "partial"
        # partial: the newest offered (version, weights); `offer` runs beside `generate`.
        self._lock = threading.Lock()
        self._newest: tuple[int, Any] | None = None

    def ping(self) -> str:
        """Answers, with the id of the Ray node it runs on, once the actor is constructed (its
        model loaded)."""
        import ray

        return ray.get_runtime_context().get_node_id()

    def generate(self, index: int, attempt: int, version: int, weights: list[Any]) -> Any:
        import ray

        # The reference travels inside a list so Ray does not fetch it before the call: a worker
        # that already holds this version (or was offered it) skips the transfer.
        state = None
        if version != self.worker.version:
            offered = self.newest()
            if offered is not None and offered[0] == version:
                state = offered[1]
            else:
                state = ray.get(weights[0], timeout=self.timeout_s)
        newest = self.newest if self.partial else None
        return self.worker.generate(index, attempt, version, state, newest)

    def offer(self, version: int, weights: list[Any]) -> None:
        """Partial mode: fetch a newly published version (its reference in a list, as in
        `generate`) for the batch running now, or the next; an older one than held is
        dropped (two offers may run side by side on a threaded actor)."""
        import ray

        with self._lock:
            if self._newest is not None and self._newest[0] >= version:
                return
        state = ray.get(weights[0], timeout=self.timeout_s)
        with self._lock:
            if self._newest is None or self._newest[0] < version:
                self._newest = (version, state)

    def newest(self) -> tuple[int, Any] | None:
        """The newest offered (version, weights), or None: the worker's `NewestWeights`."""
        with self._lock:
            return self._newest


class RayBackend:
    """Rollout workers as Ray actors; see `orchestrator.WorkerPool` for the interface."""

    def __init__(self, config: RLConfig, faults: FaultPlan | None) -> None:
        import_ray("orchestrator.backend ray")
        o = config.orchestrator
        self.ray = ray = connect(o.ray_address)
        self.config = config
        self.faults = faults
        self.workers = o.rollout_workers
        self.threads = o.rollout_threads or 1
        resources = None
        if o.ray_rollout_resource is not None:
            check_resource(ray, o.ray_rollout_resource, "orchestrator.ray_rollout_resource")
            resources = {o.ray_rollout_resource: SHARE}
        # partial: a second thread takes `offer` while `generate` runs.
        concurrency = 2 if o.mode == "partial" else 1
        self._remote = ray.remote(num_cpus=0, resources=resources, max_concurrency=concurrency)(
            _Actor
        )
        self._actors: list[Any] = [None] * self.workers
        self._started: list[cf.Future | None] = [None] * self.workers
        self._names: list[str] = [""] * self.workers
        self.nodes: dict[str, str] = {}  # worker name -> the id of the Ray node it ran on
        self._generation = 0

    def start(self, slot: int) -> None:
        self._generation += 1
        self._names[slot] = name = f"ray-worker-{slot}.{self._generation}"
        self._actors[slot] = self._remote.remote(self.config, name, slot, self.threads, self.faults)
        self._started[slot] = started = self._actors[slot].ping.remote().future()
        started.add_done_callback(lambda f: self._placed(name, f))

    def _placed(self, name: str, started: cf.Future) -> None:
        if not started.cancelled() and started.exception() is None:
            self.nodes[name] = started.result()

    def ready(self, slot: int) -> bool:
        started = self._started[slot]
        return started is not None and started.done()

    def submit(self, slot: int, index: int, attempt: int, weights: Published) -> cf.Future:
        actor = self._actors[slot]
        ref = actor.generate.remote(index, attempt, weights.version, [weights.payload])
        return self._named(ref.future(), self._names[slot])

    def _named(self, future: cf.Future, name: str) -> cf.Future:
        """`future`, with the actor's death as a `WorkerExited` naming worker `name`: Ray's own
        error reads `ActorDiedError()` in the run's error, which says not which worker died."""
        named: cf.Future = cf.Future()

        def relay(done: cf.Future) -> None:
            if done.cancelled():
                named.cancel()
            elif (error := done.exception()) is None:
                named.set_result(done.result())
            elif isinstance(error, self.ray.exceptions.RayActorError):
                why = (str(error).strip().splitlines() or [type(error).__name__])[0]
                died = WorkerExited(f"{name} exited: {why}")
                died.__cause__ = error
                named.set_exception(died)
            else:  # the worker's own exception, raised in the actor
                named.set_exception(error)

        future.add_done_callback(relay)
        return named

    def publish(self, weights: dict[str, torch.Tensor]) -> Any:
        return self.ray.put({k: v.cpu() for k, v in weights.items()})

    def offer(self, weights: Published) -> None:
        for actor in list(self._actors):  # a snapshot: the dispatcher replaces actors
            if actor is not None:  # fire and forget: a dead actor's `generate` reports it
                actor.offer.remote(weights.version, [weights.payload])

    def abandon(self, slot: int) -> None:
        actor, self._actors[slot], self._started[slot] = self._actors[slot], None, None
        if actor is not None:
            self.ray.kill(actor, no_restart=True)

    def shutdown(self) -> None:
        for slot in range(self.workers):
            self.abandon(slot)
