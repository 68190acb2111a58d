"""Rollout workers in processes of their own, `process` (spawned) and `ray` (actors) backends:
while a worker boots the trainer generates the batch it needs itself, and a worker process that
dies mid-run is replaced with nothing lost or duplicated."""

from __future__ import annotations

import importlib.util
import json
import time
from collections import Counter
from pathlib import Path

import pytest

from leantrain.rl.config import RLConfig
from leantrain.rl.grpo import GRPORun
from leantrain.rl.orchestrator import Orchestrator
from leantrain.rl.rollout_worker import FaultPlan
from leantrain.settings import load_settings

_NO_RAY = importlib.util.find_spec("ray") is None


@pytest.fixture
def backend(request: pytest.FixtureRequest):
    """The backend's name; a small local Ray around the test for `ray`."""
    if request.param == "ray":
        import ray

        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        yield "ray"
        ray.shutdown()
    else:
        yield request.param


@pytest.mark.slow  # two worker processes start (import torch): ~10-20 s on 2 idle cores
@pytest.mark.parametrize(
    "backend",
    ["process", pytest.param("ray", marks=pytest.mark.skipif(_NO_RAY, reason="needs ray"))],
    indirect=True,
)
def test_workers_take_over_from_the_trainer_and_survive_a_dead_one(
    backend: str, tiny_path: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = load_settings(
        RLConfig,
        None,
        **{
            "steps": 5,
            "out": tmp_path / backend,
            "device": "cpu",
            "task.eval_size": 2,
            "sampling.max_new_tokens": 24,
            "grpo.prompts_per_step": 2,
            "grpo.group_size": 2,
            "orchestrator.mode": "async",
            "orchestrator.backend": backend,
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
        deadline = time.monotonic() + 60
        while not orchestrator.pool.ready(0):
            assert time.monotonic() < deadline, "the worker never became ready"
            time.sleep(0.1)
        while run.step < cfg.steps:
            orchestrator.step()
        summary = orchestrator.summary()
    records = [json.loads(line) for line in (cfg.out / "metrics.jsonl").read_text().splitlines()]
    delivered = [(r["batch_worker"], r["batch_attempt"]) for r in records]
    # The first worker dies on batch 2; its replacement redoes it.
    assert delivered[:3] == [
        ("trainer", 1),
        (f"{backend}-worker-0.1", 1),
        (f"{backend}-worker-0.2", 2),
    ]
    assert summary["worker_restarts"] == 1 and summary["backend"] == backend
    assert f"{backend}-worker-0.1 exited" in caplog.text  # the dead worker, by name
    assert records[-1]["weight_publish_s"] > 0
    prompts = Counter((s, t.group_id) for s, batch in enumerate(trained) for t in batch[::2])
    assert sorted(prompts) == [(s, g) for s in range(5) for g in range(2)]
    assert set(prompts.values()) == {1}
    for step, batch in enumerate(trained):
        assert all(len(set(t.versions)) == 1 and 0 <= step - t.versions[0] <= 1 for t in batch)
