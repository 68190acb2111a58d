"""A discrete-event model of RL post-training on a cluster: predicts step time, generator idle
fraction and speedup of sync, async k=1,2 and async + speculative decoding in the tail, before
renting the cluster.

Knows nothing about models or torch: a rollout worker is `slots` sequences decoded together, one
decode iteration costs `iteration_s + sequence_s * live` seconds (the fixed cost of a forward plus
what each live sequence adds), and a sequence needs as many iterations as its response has tokens
(fewer in the tail with speculative decoding: `spec_tokens` per iteration at `spec_cost` times the
price, once `live <= spec_threshold`). The trainer needs `train_s` per step plus `sync_s` to
publish weights (rl/learner_sim.py predicts both for an FSDP2 + Ulysses learner on GPUs of a
preset; `plan(learner=...)` takes them from it). Admission follows rl/orchestrator.py: a
sequence of batch n starts only once step n - k is trained; the trainer takes batches oldest
first. `granularity="batch"` is what the local and Ray backends do (a worker generates one whole
batch at a time, on one version); `"sequence"` is DORA's streaming (a worker tops up free slots
with the next batch's prompts, one version per sequence).

Events are sequence completions and trainer steps; between two events every live sequence of a
worker advances by the same number of tokens, so a run of 10^5 sequences takes about a second.

`calibrate` fits the costs to a real run folder (metrics.jsonl): least squares of each step's
generation time on (longest response, total tokens), which is exactly a·L + c·T for one batch
decoded with continuous batching.
"""

from __future__ import annotations

import heapq
import json
import math
from collections import deque
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

import numpy as np

from leantrain.errors import LeantrainError
from leantrain.rl.learner_sim import LearnerSetup, predict_learner


@dataclass(frozen=True)
class Cluster:
    """Costs of the simulated machines.

    Attributes:
        rollout_workers: rollout engines (accelerators or groups of them), each one version.
        slots: sequences one worker decodes at once.
        iteration_s: fixed seconds of one decode iteration (a forward of the live batch).
        sequence_s: seconds each live sequence adds to an iteration.
        train_s: trainer seconds per optimizer step.
        sync_s: seconds to publish a step's weights to the workers.
        spec_threshold: speculative decoding when a worker has <= this many live sequences;
            0 turns it off.
        spec_tokens: tokens per sequence a speculative iteration yields (accepted drafts + 1).
        spec_cost: price of a speculative iteration relative to a plain one.
    """

    rollout_workers: int = 1
    slots: int = 128
    iteration_s: float = 0.01
    sequence_s: float = 0.0
    train_s: float = 1.0
    sync_s: float = 0.0
    spec_threshold: int = 0
    spec_tokens: float = 1.0
    spec_cost: float = 1.0

    def __post_init__(self) -> None:
        if self.rollout_workers < 1 or self.slots < 1:
            raise LeantrainError("Cluster needs rollout_workers >= 1 and slots >= 1")
        if min(self.iteration_s, self.sequence_s, self.train_s, self.sync_s) < 0:
            raise LeantrainError("Cluster costs must be >= 0 seconds")
        if self.spec_tokens < 1 or self.spec_cost <= 0:
            raise LeantrainError("Cluster needs spec_tokens >= 1 and spec_cost > 0")

    def seconds_per_token(self, live: int) -> float:
        """Seconds for every one of `live` sequences to advance by one token."""
        cost = self.iteration_s + self.sequence_s * live
        if 0 < live <= self.spec_threshold:
            return cost * self.spec_cost / self.spec_tokens
        return cost


@dataclass(frozen=True)
class Workload:
    """What is trained: `steps` batches of `sequences` responses whose lengths are drawn (with
    replacement, seeded) from `lengths`."""

    steps: int
    sequences: int
    lengths: tuple[int, ...]
    seed: int = 0

    def __post_init__(self) -> None:
        if self.steps < 1 or self.sequences < 1:
            raise LeantrainError("Workload needs steps >= 1 and sequences >= 1")
        if not self.lengths or min(self.lengths) < 1:
            raise LeantrainError("Workload.lengths must be a non-empty list of lengths >= 1")


@dataclass
class Prediction:
    """What `simulate` predicts for one setup."""

    seconds: float  # until the last step is trained
    step_s: float  # seconds per step
    generation_idle: float  # share of worker-seconds with nothing to decode
    trainer_idle: float  # share of the run the trainer waited for a batch
    max_staleness: int  # k of the run (sync: 0)


@dataclass
class _Worker:
    remaining: np.ndarray = field(default_factory=lambda: np.zeros(0))  # tokens left, per live
    batch: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=int))  # batch of each
    queue: deque = field(default_factory=deque)  # batch granularity: this worker's backlog
    since: float = 0.0  # time `remaining` was last brought up to date
    busy_s: float = 0.0
    epoch: int = 0  # invalidates a scheduled event when the worker is rescheduled


def simulate(
    cluster: Cluster,
    workload: Workload,
    max_staleness: int,
    granularity: Literal["batch", "sequence"] = "batch",
) -> Prediction:
    """Run the event model; `max_staleness` 0 is the synchronous run."""
    rng = np.random.default_rng(workload.seed)
    pool = np.asarray(workload.lengths, dtype=float)
    lengths = [rng.choice(pool, workload.sequences) for _ in range(workload.steps)]
    left = [workload.sequences] * workload.steps  # unfinished sequences of each batch
    pending: deque = deque(  # sequence granularity: (batch, length) in batch order
        (n, x) for n in range(workload.steps) for x in lengths[n]
    )
    next_batch = 0  # batch granularity: the next batch to hand to a worker
    workers = [_Worker() for _ in range(cluster.rollout_workers)]
    events: list[tuple[float, int, int, int]] = []  # (time, order, worker or -1, epoch)
    order = 0
    trained, trainer_busy, trainer_wait_s, trainer_free_at = 0, False, 0.0, 0.0

    def advance(w: _Worker, now: float) -> None:
        live = len(w.remaining)
        if live:
            w.remaining = w.remaining - (now - w.since) / cluster.seconds_per_token(live)
            w.busy_s += now - w.since
        w.since = now

    def admit(w: _Worker) -> None:
        nonlocal next_batch
        idle = not len(w.remaining) and not w.queue
        allowed = next_batch < workload.steps and next_batch <= trained + max_staleness
        if granularity == "batch" and idle and allowed:
            w.queue.extend((next_batch, x) for x in lengths[next_batch])
            next_batch += 1
        source = w.queue if granularity == "batch" else pending
        new = []
        while source and len(w.remaining) + len(new) < cluster.slots:
            if source[0][0] > trained + max_staleness:
                break
            new.append(source.popleft())
        if new:
            w.remaining = np.concatenate([w.remaining, [x for _, x in new]])
            w.batch = np.concatenate([w.batch, [n for n, _ in new]]).astype(int)

    def schedule(i: int, now: float) -> None:
        nonlocal order
        w = workers[i]
        w.epoch += 1
        if len(w.remaining):
            finish = now + w.remaining.min() * cluster.seconds_per_token(len(w.remaining))
            order += 1
            heapq.heappush(events, (finish, order, i, w.epoch))

    def start_training(now: float) -> None:
        nonlocal trainer_busy, trainer_wait_s, order
        if not trainer_busy and trained < workload.steps and left[trained] == 0:
            trainer_busy = True
            trainer_wait_s += now - trainer_free_at
            order += 1
            heapq.heappush(events, (now + cluster.train_s + cluster.sync_s, order, -1, 0))

    for i, w in enumerate(workers):
        admit(w)
        schedule(i, 0.0)
    now = 0.0
    while events:
        now, _, i, epoch = heapq.heappop(events)
        if i == -1:  # a step trained and its weights published: admission moves on
            trained, trainer_busy, trainer_free_at = trained + 1, False, now
            for j, w in enumerate(workers):
                advance(w, now)
                admit(w)
                schedule(j, now)
            start_training(now)
            continue
        w = workers[i]
        if epoch != w.epoch:
            continue  # superseded by a reschedule
        advance(w, now)
        done = w.remaining <= 1e-9
        for n in w.batch[done]:
            left[n] -= 1
        w.remaining, w.batch = w.remaining[~done], w.batch[~done]
        admit(w)
        schedule(i, now)
        start_training(now)
    if trained < workload.steps:
        raise LeantrainError(f"simulation stalled after {trained} of {workload.steps} steps")
    worker_s = now * cluster.rollout_workers
    return Prediction(
        seconds=float(now),
        step_s=float(now / workload.steps),
        generation_idle=float(1 - sum(w.busy_s for w in workers) / max(worker_s, 1e-12)),
        trainer_idle=float(trainer_wait_s / max(now, 1e-12)),
        max_staleness=max_staleness,
    )


@dataclass(frozen=True)
class Calibration:
    """A cluster and workload fitted to a real run."""

    cluster: Cluster
    workload: Workload
    fit_error: float  # relative RMS error of the generation-time fit over the run's steps


def calibrate(run_dir: Path, slots: int = 128) -> Calibration:
    """Fit `Cluster` costs and the length distribution to a run folder's metrics.jsonl.

    Needs the per-step `generate_s`, `train_s` and `response_lengths` that every leantrain run
    logs. Generation time of a batch decoded with continuous batching (all sequences fit in
    `slots`) is a·L + c·T: L iterations (the longest response), T sequence-iterations (all
    tokens); a non-negative least-squares fit gives a and c.
    """
    from scipy.optimize import nnls

    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise LeantrainError(f"no metrics.jsonl in {run_dir}: point --run at a run folder")
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    records = [r for r in records if r.get("response_lengths")]
    if len(records) < 2:
        raise LeantrainError(
            f"{path}: need at least 2 steps that log response_lengths, found {len(records)}"
        )
    lengths = [r["response_lengths"] for r in records]
    design = np.array([[max(x), sum(x)] for x in lengths], dtype=float)  # (steps, 2)
    gen = np.array([r["generate_s"] for r in records])
    (a, c), _ = nnls(design, gen)
    fit = design @ np.array([a, c])
    fit_error = float(np.sqrt(np.mean(((fit - gen) / gen) ** 2)))
    sync = [r.get("weight_publish_s", 0.0) + r.get("weight_load_s", 0.0) for r in records]
    cluster = Cluster(
        rollout_workers=1,
        slots=slots,
        iteration_s=float(a),
        sequence_s=float(c),
        train_s=float(np.median([r["train_s"] for r in records])),
        sync_s=float(np.median(sync)),
    )
    workload = Workload(
        steps=len(records),
        sequences=len(lengths[0]),
        lengths=tuple(int(x) for step in lengths for x in step),
    )
    return Calibration(cluster, workload, fit_error)


def lognormal_lengths(
    median: float, p90: float, cap: int, n: int = 4096, seed: int = 0
) -> tuple[int, ...]:
    """`n` response lengths from the log-normal with this median and 90th percentile, cut at
    `cap` (the generation budget): a long tail like reasoning RL's."""
    if not 1 <= median < p90:
        raise LeantrainError(f"need 1 <= median < p90, got median {median}, p90 {p90}")
    sigma = math.log(p90 / median) / 1.2816  # z of the 90th percentile
    draws = np.random.default_rng(seed).lognormal(math.log(median), sigma, n)
    return tuple(int(x) for x in np.clip(np.round(draws), 1, cap))


@dataclass(frozen=True)
class PlanRow:
    accelerators: int
    setup: str
    step_s: float
    generation_idle: float
    speedup: float  # over sync at the same accelerator count


def plan(
    accelerators: list[int],
    *,
    sequences: int = 8192,
    lengths: tuple[int, ...],
    steps: int = 6,
    slots: int = 256,
    iteration_s: float = 0.025,
    sequence_s: float = 0.0001,
    train_token_s: float = 6 * 7e9 / (0.4 * 1e15),
    sync_s: float = 5.0,
    rollout_share: float = 0.75,
    spec: tuple[int, float, float] = (32, 2.5, 1.3),
    learner: LearnerSetup | None = None,
) -> list[PlanRow]:
    """Sync (colocated: every accelerator rolls out, then every one trains) against async k=1,
    k=2 and async k=1 with speculative decoding in the tail (disaggregated: `rollout_share` of
    the accelerators roll out, the rest train), at each accelerator count, with DORA's
    per-sequence streaming. `spec` is (threshold, tokens per iteration, cost).

    The defaults are ASSUMPTIONS for a 7B-class model on H100-class accelerators, one rollout
    engine per accelerator: a decode iteration of 256 sequences costs 25 ms (memory-bound),
    training costs 6 * 7e9 FLOPs per token at 40% of 1 PFLOP/s (`train_token_s`, seconds per
    token on one accelerator; a step's tokens split evenly), publishing weights 5 s.

    `learner` replaces the last two assumptions with the learner model (rl/learner_sim.py): each
    setup's trainer accelerators become its `gpus`, the step's response tokens its `tokens`, and
    its predicted step and weight sync the cluster's `train_s` and `sync_s`."""
    rows: list[PlanRow] = []
    workload = Workload(steps=steps, sequences=sequences, lengths=lengths)
    tokens = sequences * float(np.mean(lengths))

    def trainer(gpus: int) -> tuple[float, float]:  # (train_s, sync_s) on `gpus` trainers
        if learner is None:
            return tokens * train_token_s / gpus, sync_s
        p = predict_learner(replace(learner, gpus=gpus, tokens=tokens))
        return p.train_s, p.sync_s

    for n in accelerators:
        roll = max(1, round(n * rollout_share))
        colocated = Cluster(n, slots, iteration_s, sequence_s, *trainer(n))
        split_train, split_sync = trainer(max(1, n - roll))
        split = replace(colocated, rollout_workers=roll, train_s=split_train, sync_s=split_sync)
        setups = {
            "sync": (colocated, 0),
            "async k=1": (split, 1),
            "async k=2": (split, 2),
            "async k=1 + SD": (
                replace(split, spec_threshold=spec[0], spec_tokens=spec[1], spec_cost=spec[2]),
                1,
            ),
        }
        base = None
        for name, (cluster, k) in setups.items():
            p = simulate(cluster, workload, k, granularity="sequence")
            base = base or p.step_s
            rows.append(PlanRow(n, name, p.step_s, p.generation_idle, base / p.step_s))
    return rows


def plot_plan(rows: list[PlanRow], out: Path) -> Path:
    """Speedup over sync and seconds per step against accelerator count, one line per setup."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    setups = list(dict.fromkeys(r.setup for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for setup in setups:
        mine = [r for r in rows if r.setup == setup]
        xs = [r.accelerators for r in mine]
        axes[0].plot(xs, [r.speedup for r in mine], marker="o", label=setup)
        axes[1].plot(xs, [r.step_s for r in mine], marker="o", label=setup)
    for ax, label in zip(axes, ("speedup over sync", "seconds per step"), strict=True):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("accelerators")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("leantrain simulate --plan (assumed 7B-class model, see rl/simulate.py)")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
