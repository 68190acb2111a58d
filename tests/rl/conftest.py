"""What the RL tests share: each out-of-process rollout worker kind."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

# The `ray` case joins every test that starts Ray on one pytest worker (`make test`: --dist
# loadgroup; tests/distributed/test_ray_group.py says why).
RAY_GROUP = pytest.mark.xdist_group("ray")


@pytest.fixture(params=["process", pytest.param("ray", marks=RAY_GROUP)])
def worker_backend(request: pytest.FixtureRequest) -> Iterator[str]:
    """`orchestrator.backend` for a worker outside the trainer's process: `process`, then `ray`
    with a small local Ray around the test (failed in CI where Ray is missing: `ray_installed`)."""
    if request.param != "ray":
        yield request.param
        return
    request.getfixturevalue("ray_installed")
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield "ray"
    ray.shutdown()
