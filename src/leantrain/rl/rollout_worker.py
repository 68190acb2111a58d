"""A rollout worker: its own copy of the policy and its own rollout engine; given a step index and
a weight version, it generates and scores that step's batch. The same class runs in a thread
(rl/async_local.py), a spawned process (rl/async_process.py; with `rollout.backend: vllm` it
holds the process's one vLLM engine) or inside a Ray actor (rl/ray_backend.py). With
`rollout.backend: vllm_server` its engine is an HTTP client of the servers that are its own
(its `slot`'s share of `rollout.vllm_urls`), into which it loads each version as a local engine.

Knows nothing about scheduling, buffers or other workers. Two ways to use a version:

- `async` (DORA's intra-trajectory consistency): the whole batch is generated on the version it
  started on; weights published meanwhile wait for the next batch.
- `partial` (abort and resume, as slime's fully-async mode and PipelineRL): the batch decodes in
  segments of `segment_tokens`; before each segment the worker loads the newest version if there
  is one, and in-flight sequences resume on it (re-prefilled from their tokens so far). Each
  token records the version that sampled it (checked against the backend's own record where
  it keeps one: vLLM's); the loss corrects for the mix (rl/losses.py). The newest version is
  `newest`, given by the backend: a thread's reads the trainer's weight store, a process's or
  Ray actor's the newest version offered to it while the batch runs. On
  a backend that takes weights in the middle of a batch (`live_weights`: vLLM servers) there are
  no segments: the batch is one `generate`, and a watcher thread loads each newer version into
  it while it runs (pause, reload, resume); the backend's own record says each token's version.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from leantrain.errors import LeantrainError
from leantrain.generation import Completion
from leantrain.models import load_model, pick_device
from leantrain.rl.buffer import RolloutBatch
from leantrain.rl.config import RLConfig
from leantrain.rl.rollout import RolloutSource, rollout_backend, sampled_versions
from leantrain.tasks import Example, make_task
from leantrain.telemetry.events import SeqTimeline, SpanTrack

# Seeds of a partial-mode batch's later segments: a stream apart from the first segment's seed.
_SEGMENT_SEED_STRIDE = 1_000_033
# Partial mode on a `live_weights` backend: seconds between looks at the weight store.
_POLL_S = 0.02


class WorkerCrash(RuntimeError):
    """An injected fault: the worker dies with its batch generated but not delivered."""


@dataclass(frozen=True)
class FaultPlan:
    """Faults to inject, for tests: each is a (batch index, attempt) pair.

    Attributes:
        crash: the worker dies after generating the batch, before delivering it.
        stall: the worker hangs for `stall_s` seconds after generating the batch.
        stall_s: how long a stall lasts.
        hard_exit: a crash kills the process (a Ray actor's death) instead of raising.
    """

    crash: frozenset[tuple[int, int]] = frozenset()
    stall: frozenset[tuple[int, int]] = frozenset()
    stall_s: float = 60.0
    hard_exit: bool = False

    def strike(self, index: int, attempt: int) -> None:
        if (index, attempt) in self.stall:
            time.sleep(self.stall_s)
        if (index, attempt) in self.crash:
            if self.hard_exit:
                os._exit(1)
            raise WorkerCrash(f"injected crash on batch {index}, attempt {attempt}")


# partial mode: () -> (version, weights) of the newest published version, or None.
NewestWeights = Callable[[], tuple[int, Any] | None]


class RolloutWorker:
    """One policy copy and engine; `generate` turns (step, version) into a scored batch. `slot`
    is its place among the run's workers (on vLLM servers, which servers are its own)."""

    def __init__(
        self, config: RLConfig, name: str, faults: FaultPlan | None = None, slot: int = 0
    ) -> None:
        self.track = SpanTrack(name, "start")  # this worker's spans, sent with each batch
        self.config = config
        self.name = name
        self.faults = faults or FaultPlan()
        # On CUDA the copy shares the trainer's GPU (colocated rollouts); fp32 like the trainer.
        self.device = pick_device(config.device)
        model, tokenizer = load_model(config.model.name, device=str(self.device), dtype="float32")
        model.eval().requires_grad_(False)
        task = make_task(config.task.name, **config.task.options)
        # The trainer's own backend and rollout path, on this worker's copy of the policy.
        backend = rollout_backend(config, model, tokenizer, task, worker=slot)
        self.source = RolloutSource(config, backend, tokenizer, task, self.device)
        self.version = -1  # nothing loaded yet
        self.track.enter("idle")

    def load(self, version: int, weights: dict[str, torch.Tensor]) -> float:
        """Load a published version (a state dict) into this worker's backend; returns
        seconds."""
        t0 = time.perf_counter()
        self.source.backend.load_weights(weights, version)
        self.version = version
        return time.perf_counter() - t0

    def generate(
        self,
        index: int,
        attempt: int,
        version: int,
        weights: dict[str, torch.Tensor] | None,
        newest: NewestWeights | None = None,
    ) -> RolloutBatch:
        """Generate and score batch `index` starting on `version` (`weights`, or None when this
        worker already holds it). Partial mode polls `newest` between segments."""
        sync_s = switch_s = 0.0
        if version != self.version:
            if weights is None:
                raise LeantrainError(
                    f"{self.name} holds version {self.version} but was sent no weights for "
                    f"version {version}"
                )
            self.track.enter("load", batch=index, version=version)
            sync_s += self.load(version, weights)
        self.track.enter("generate", batch=index, version=version)
        t0 = time.perf_counter()
        if (
            self.config.orchestrator.mode == "partial"
            and self.source.backend.capabilities.live_weights
        ):
            examples, completions, switch_s = self._live(index, newest)
            versions = sampled_versions(completions, version, live=True)
        elif self.config.orchestrator.mode == "partial":
            examples, prompts, seed = self.source.batch(index)
            with self.source.autocast():
                completions, versions, switch_s = self._segments(prompts, seed, newest)
        else:
            examples, completions = self.source.sample(index)
            versions = sampled_versions(completions, version)  # vLLM's own record, checked
        self.faults.strike(index, attempt)
        self.track.enter("score", batch=index)
        trajectories = self.source.score(examples, completions, versions)
        self.track.enter("idle")
        return RolloutBatch(
            index=index,
            trajectories=trajectories,
            version=version,
            worker=self.name,
            attempt=attempt,
            generate_s=time.perf_counter() - t0 - switch_s,
            weight_sync_s=sync_s + switch_s,
            events=self.track.drain(),
        )

    def _live(
        self, index: int, newest: NewestWeights | None
    ) -> tuple[list[Example], list[Completion], float]:
        """Partial mode on a `live_weights` backend: batch `index` in one `generate`, while a
        watcher thread loads every newer version into the backend as it is published. Returns
        the examples, the completions and the seconds spent loading (generation waits
        meanwhile)."""
        done = threading.Event()
        loads: list[float] = []
        failed: list[BaseException] = []

        def watch() -> None:
            try:
                while not done.wait(_POLL_S):
                    latest = newest() if newest is not None else None
                    if latest is not None and latest[0] > self.version:
                        t0 = time.perf_counter()
                        self.source.backend.load_weights_live(latest[1], latest[0])
                        self.version = latest[0]
                        loads.append(time.perf_counter() - t0)
            except BaseException as e:  # raised in the worker's thread, after the batch
                failed.append(e)

        watcher = threading.Thread(target=watch, name=f"{self.name}-weights", daemon=True)
        watcher.start()
        try:
            examples, completions = self.source.sample(index)
        finally:
            done.set()
            watcher.join()
        if failed:
            raise failed[0]
        return examples, completions, sum(loads)

    def _segments(
        self, prompts: list[list[int]], seed: int, newest: NewestWeights | None
    ) -> tuple[list[Completion], list[list[int]], float]:
        """Partial mode: decode `segment_tokens` at a time, switching to newer weights between
        segments. Returns the completions, each token's version, and seconds spent loading."""
        sampling = self.config.sampling
        budget = sampling.max_new_tokens
        segment_tokens = min(budget, self.config.orchestrator.segment_tokens)
        segment = sampling.model_copy(update={"max_new_tokens": segment_tokens})
        partial = [Completion(list(p), [], [], "length", timeline=SeqTimeline()) for p in prompts]
        versions: list[list[int]] = [[] for _ in prompts]
        sync_s = 0.0
        live = list(range(len(prompts)))
        for k in range(budget):  # at most one segment per token; ends far sooner
            if not live:
                break
            latest = newest() if newest is not None else None
            if latest is not None and latest[0] > self.version:
                sync_s += self.load(*latest)  # abort and resume on the new version
            outs = self.source.backend.generate(
                [partial[i].prompt_ids + partial[i].response_ids for i in live],
                segment,
                seed=seed + k * _SEGMENT_SEED_STRIDE,
            )
            # vLLM's own record of the segment's versions, checked to be the one loaded.
            sampled = sampled_versions(outs, self.version)
            still = []
            for i, out, out_versions in zip(live, outs, sampled, strict=True):
                c = partial[i]
                room = budget - len(c.response_ids)
                c.response_ids += out.response_ids[:room]
                c.logprobs += out.logprobs[:room]
                c.timeline.then(out.timeline)  # the time between segments is a `wait` span
                versions[i] += out_versions[:room]
                if out.finish_reason != "length" and len(out.response_ids) <= room:
                    c.finish_reason = out.finish_reason  # eos or stop: finished
                elif len(c.response_ids) < budget:
                    still.append(i)  # cut by the segment, not the budget: goes on
            live = still
        return partial, versions, sync_s
