"""The Ray backend in a small local Ray: rollout actors in their own processes, weights through
the object store, and an actor whose process dies mid-run replaced with nothing lost."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from leantrain.config import load_config
from leantrain.rl.grpo import GRPORun
from leantrain.rl.orchestrator import AsyncOrchestrator
from leantrain.rl.rollout_worker import FaultPlan

ray = pytest.importorskip("ray")


@pytest.fixture
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.mark.slow  # Ray start-up and two actor processes: ~20 s on 2 idle cores
def test_ray_workers_survive_a_dead_actor(local_ray, tiny_path: Path, tmp_path: Path) -> None:
    cfg = load_config(
        None,
        **{
            "steps": 3,
            "out": tmp_path / "ray",
            "device": "cpu",
            "task.eval_size": 2,
            "sampling.max_new_tokens": 24,
            "grpo.prompts_per_step": 2,
            "grpo.group_size": 2,
            "orchestrator.mode": "async",
            "orchestrator.backend": "ray",
            "orchestrator.max_staleness": 1,
            "orchestrator.timeout_s": 60.0,
        },
    )
    run = GRPORun(cfg, progress=False)
    trained = []
    train_step = run.train_step

    def keep(trajectories, **kwargs):
        trained.append(trajectories)
        return train_step(trajectories, **kwargs)

    run.train_step = keep
    # The actor's process exits while holding batch 1: Ray reports the actor dead.
    faults = FaultPlan(crash=frozenset({(1, 1)}), hard_exit=True)
    with AsyncOrchestrator(run, faults) as orchestrator:
        while run.step < cfg.steps:
            record = orchestrator.step(_Totals())
        summary = orchestrator.summary()
    assert summary["worker_restarts"] == 1 and summary["backend"] == "ray"
    assert record["weight_publish_s"] > 0
    prompts = Counter((s, t.group_id) for s, batch in enumerate(trained) for t in batch[::2])
    assert sorted(prompts) == [(s, g) for s in range(3) for g in range(2)]
    assert set(prompts.values()) == {1}
    for step, batch in enumerate(trained):
        assert all(len(set(t.versions)) == 1 and step - t.versions[0] <= 1 for t in batch)


class _Totals:
    generate_s = 0.0
    train_s = 0.0
