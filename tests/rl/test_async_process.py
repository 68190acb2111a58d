"""Rollout workers in processes of their own, `process` (spawned) and `ray` (actors) backends:
while a worker boots the trainer generates the batch it needs itself, a worker process that
dies mid-run is replaced with nothing lost or duplicated, and in partial mode a worker's batch
in flight switches to each version the trainer publishes (offered to the process or actor),
every token carrying the version that sampled it."""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

import pytest
from rl_runs import reordered_sum_tolerance, run_steps
from transformers import AutoConfig

from leantrain.distributed import leave
from leantrain.distributed.launch import spawn_ranks
from leantrain.rl.config import RLConfig
from leantrain.rl.grpo import GRPORun
from leantrain.rl.orchestrator import Orchestrator
from leantrain.rl.rollout_worker import FaultPlan
from leantrain.settings import load_settings


def _wait_for_worker(orchestrator: Orchestrator, timeout_s: float) -> None:
    """Until worker 0 has booted (it imports torch and loads the model)."""
    deadline = time.monotonic() + timeout_s
    while not orchestrator.pool.ready(0):
        assert time.monotonic() < deadline, "the worker never became ready"
        time.sleep(0.1)


@pytest.mark.slow  # two worker processes start (import torch): ~10-20 s on 2 idle cores
def test_workers_take_over_from_the_trainer_and_survive_a_dead_one(
    worker_backend: str, tiny_path: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = load_settings(
        RLConfig,
        None,
        **{
            "steps": 5,
            "out": tmp_path / worker_backend,
            "device": "cpu",
            "task.eval_size": 2,
            "sampling.max_new_tokens": 24,
            "grpo.prompts_per_step": 2,
            "grpo.group_size": 2,
            "orchestrator.mode": "async",
            "orchestrator.backend": worker_backend,
            "orchestrator.max_staleness": 1,
            "orchestrator.timeout_s": 60.0,
        },
    )
    run = GRPORun(cfg, progress=False)
    trained = []
    train_step = run.learner.step

    def keep(trajectories, **kwargs):
        trained.append(trajectories)
        return train_step(trajectories, **kwargs)

    run.learner.step = keep
    # The worker's process exits while holding batch 2 (an actor's death, for Ray). It holds the
    # batch 5 s first: the trainer claims a batch for itself only at the start of a step, so it
    # must already be waiting for batch 2 when the worker dies, or it would take the re-queued
    # batch itself while the replacement boots (a race a fast engine used to lose).
    faults = FaultPlan(
        crash=frozenset({(2, 1)}), stall=frozenset({(2, 1)}), stall_s=5.0, hard_exit=True
    )
    with Orchestrator(run.config, run.learner, run.source, run.log_step, faults) as orchestrator:
        orchestrator.step()  # the worker still imports torch: the trainer's batch
        _wait_for_worker(orchestrator, 60)
        while run.step < cfg.steps:
            orchestrator.step()
        summary = orchestrator.summary()
    records = [json.loads(line) for line in (cfg.out / "metrics.jsonl").read_text().splitlines()]
    delivered = [(r["batch_worker"], r["batch_attempt"]) for r in records]
    # The first worker dies on batch 2; its replacement redoes it.
    assert delivered[:3] == [
        ("trainer", 1),
        (f"{worker_backend}-worker-0.1", 1),
        (f"{worker_backend}-worker-0.2", 2),
    ]
    assert summary["worker_restarts"] == 1 and summary["backend"] == worker_backend
    assert f"{worker_backend}-worker-0.1 exited" in caplog.text  # the dead worker, by name
    assert records[-1]["weight_publish_s"] > 0
    prompts = Counter((s, t.group_id) for s, batch in enumerate(trained) for t in batch[::2])
    assert sorted(prompts) == [(s, g) for s in range(5) for g in range(2)]
    assert set(prompts.values()) == {1}
    for step, batch in enumerate(trained):
        assert all(len(set(t.versions)) == 1 and 0 <= step - t.versions[0] <= 1 for t in batch)


ASYNC_ON_TWO_RANKS = {
    "steps": 5,
    "device": "cpu",
    "threads": 1,
    "task.eval_size": 2,
    "sampling.max_new_tokens": 24,
    "grpo.prompts_per_step": 2,
    "grpo.group_size": 4,
    "grpo.lr": 1e-3,
    "orchestrator.mode": "async",
    "orchestrator.backend": "process",
    "orchestrator.max_staleness": 1,
    "orchestrator.timeout_s": 120.0,
    "distributed.timeout_s": 120.0,
}


def _async_rank(rank: int, model: str, out: str) -> None:
    """Rank 0 drives the orchestrator as `GRPORun.run` does, but waits for its worker to boot
    after the first step (the tiny model would otherwise finish before it does); rank 1 is
    what any other rank runs (`_follow`)."""
    cfg = load_settings(RLConfig, None, **ASYNC_ON_TWO_RANKS, **{"model.name": model}, out=out)
    run = GRPORun(cfg, progress=False)
    if rank != 0:
        run.run()
        return
    with Orchestrator(cfg, run.learner, run.source, run.log_step) as orchestrator:
        orchestrator.step()
        _wait_for_worker(orchestrator, 120)
        while run.step < cfg.steps:
            orchestrator.step()
            if run._checkpoint_due():  # the other rank writes its shards at the same steps
                run._checkpoint()
    leave()


@pytest.mark.slow  # 2 ranks and a worker process start (import torch): ~30-60 s on 2 cores
def test_async_on_two_ranks_trains_worker_batches_in_lockstep(
    tiny_path: Path, tmp_path: Path
) -> None:
    """Async over 2 data-parallel ranks: rank 0 takes batches from a rollout worker process and
    publishes from its unsharded copy, rank 1 trains its share of each in lockstep. Worker
    batches are trained within the staleness bound, and step 1 (the trainer's batch 0 on the
    starting weights) has the loss and gradient norm of one process on the same batch."""
    codes = spawn_ranks(_async_rank, (str(tiny_path), str(tmp_path / "two")), timeout_s=400)
    assert codes == [0, 0]
    records = [
        json.loads(x) for x in (tmp_path / "two" / "metrics.jsonl").read_text().split("\n") if x
    ]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert any(r["batch_worker"].startswith("process-worker") for r in records)
    assert all(r["staleness_max"] <= 1 for r in records)
    cfg = load_settings(
        RLConfig,
        None,
        **{**ASYNC_ON_TWO_RANKS, "orchestrator.mode": "sync", "steps": 1},
        **{"model.name": str(tiny_path)},
        out=tmp_path / "one",
    )
    one = GRPORun(cfg, progress=False)
    one.run()
    first = one.metrics.read()[0]
    assert records[0]["batch_worker"] == "trainer" and records[0]["reward"] == first["reward"]
    for key in ("loss", "grad_norm"):
        assert abs(records[0][key] - first[key]) <= 1e-5, key


@pytest.mark.slow  # a worker process or Ray actor starts (imports torch): ~15-30 s on 2 cores
# Not `worker_backend`: run_steps starts the local Ray itself. The `ray` case joins the Ray
# tests' group (tests/rl/conftest.py).
@pytest.mark.parametrize(
    "backend", ["process", pytest.param("ray", marks=pytest.mark.xdist_group("ray"))]
)
def test_partial_on_worker_processes_switches_versions_mid_batch_with_exact_tokens(
    backend: str, tiny_path: Path, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """Partial mode on a spawned process or a Ray actor: each publish is offered to the worker
    while its batch runs, and its segments resume on it. No token is older than step - k; at
    least one trajectory mixes two versions; every token's
    behaviour logprob is a fresh trainer forward's of the version it carries (within the
    reordered-sum bound of tests/support/rl_runs.py), far from version 0's."""
    if backend == "ray":
        request.getfixturevalue("ray_installed")
    k = 2  # the worker never waits for weights: nearly every publish lands mid-batch
    cfg = load_settings(
        RLConfig,
        None,
        **{
            "model.name": str(tiny_path),
            "steps": 5,
            "out": tmp_path / backend,
            "device": "cpu",
            "task.eval_size": 2,
            "checkpoint_every": 100,
            "sampling.max_new_tokens": 48,
            "grpo.prompts_per_step": 2,
            "grpo.group_size": 4,
            "grpo.lr": 1e-3,
            "grpo.warmup_steps": 0,
            "orchestrator.mode": "partial",
            "orchestrator.backend": backend,
            "orchestrator.max_staleness": k,
            "orchestrator.segment_tokens": 4,
            "orchestrator.off_policy": "tis",
            "orchestrator.timeout_s": 60.0,
        },
    )
    steps = run_steps(cfg)
    records = [json.loads(line) for line in (cfg.out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert records[0]["batch_worker"] == "trainer"  # the worker still booted
    assert all(r["batch_worker"].startswith(f"{backend}-worker-0.") for r in records[1:])
    # Prompt plus response stay far below the MLP's width, which sets the bound.
    tolerance = reordered_sum_tolerance(AutoConfig.from_pretrained(tiny_path), seq_len=0)
    for step, (r, s) in enumerate(zip(records, steps, strict=True)):
        assert r["staleness_max"] <= k
        assert all(min(vs) >= max(0, step - k) for vs in s["versions"]), (step, s["versions"])
        assert s["logprob_gap"] < tolerance, (step, s["logprob_gap"])
        if r["batch_version"] > 0:  # sampled on published weights, not the starting ones
            assert s["gap_to_v0"] > 1e-3, (step, s["gap_to_v0"])
    mixed = [r["mixed_version_trajectories"] for r in records]
    print(f"partial on a {backend} worker: trajectories with two versions per step {mixed}")
    assert sum(mixed) > 0  # offers did reach a batch in flight
