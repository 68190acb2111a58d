"""Ray placement on a local 2-node Ray cluster (`ray.cluster_utils.Cluster`: two raylets on this
machine, one offering the `learner` resource, one `rollout`): a learner group lands on the learner
node with torchrun's environment and joins one gloo process group; a GRPO run on the tiny model
places its learner rank and its rollout worker each on its node; a resource no node offers is a
named error at once, never a pending group."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from leantrain.errors import LeantrainError
from leantrain.rl.config import RLConfig

pytestmark = [
    pytest.mark.slow,  # two raylets and an actor per rank: ~10 s before any test runs
    pytest.mark.usefixtures("ray_installed"),  # fails in CI where Ray is missing
    # One pytest worker runs the tests that start Ray (`make test`: --dist loadgroup; all but
    # test_async_vllm.py's server case, which stays with its server's group): two Ray instances
    # side by side on 2 cores took over 60 s to start their actors.
    pytest.mark.xdist_group("ray"),
]


@pytest.fixture(scope="module")
def cluster(tiny_path: Path):
    """The 2-node cluster, connected; yields {"learner": node id, "rollout": node id}."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    from ray.cluster_utils import Cluster

    head = {"num_cpus": 1, "resources": {"learner": 1}, "include_dashboard": False}
    nodes = Cluster(initialize_head=True, head_node_args=head)
    try:
        nodes.add_node(num_cpus=1, resources={"rollout": 1})
        ray.init(address=nodes.address, log_to_driver=False)
        ids = {
            name: n["NodeID"]
            for n in ray.nodes()
            for name in ("learner", "rollout")
            if n["Resources"].get(name)
        }
        yield {"address": nodes.address, **ids}
    finally:
        ray.shutdown()
        nodes.shutdown()


def test_learner_group_lands_on_the_learner_node_as_one_process_group(cluster) -> None:
    from leantrain.distributed.ray_group import run_group

    def rank() -> tuple[float, dict[str, str]]:  # pickled by value: runs in each rank's actor
        import torch
        import torch.distributed as dist

        from leantrain.distributed import join, leave

        join(torch.device("cpu"), timeout_s=60)
        total = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(total)
        leave()
        env = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
        return total.item(), {k: os.environ[k] for k in env}

    placed = run_group(rank, (), ranks=2, resource="learner", timeout_s=60)
    assert [p.node_id for p in placed] == [cluster["learner"]] * 2
    assert [p.value[0] for p in placed] == [3.0, 3.0]  # 1 + 2, over gloo between the actors
    assert [p.value[1] for p in placed] == [
        {"RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": "2"}
        for r in range(2)
    ]


@pytest.mark.parametrize("how", ["raises", "exits"])
def test_a_failing_rank_ends_the_group_at_once_naming_it(cluster, how: str) -> None:
    from leantrain.distributed.ray_group import run_group

    def rank(how: str) -> None:
        if os.environ["RANK"] == "0":
            time.sleep(600)  # as if waiting in a collective for rank 1: killed, not waited for
        elif how == "raises":
            raise RuntimeError("rank one broke")
        else:
            os._exit(1)  # the process dies outright

    start = time.monotonic()
    with pytest.raises(LeantrainError, match="rank 1 of 2 failed") as failed:
        run_group(rank, (how,), ranks=2, resource="learner", timeout_s=60)
    assert time.monotonic() - start < 60
    assert str(failed.value).endswith("rank one broke" if how == "raises" else "its process died")


def test_a_resource_no_node_offers_is_named_at_once(cluster) -> None:
    from leantrain.distributed.ray_group import run_group
    from leantrain.rl.config import RLConfig
    from leantrain.rl.ray_backend import RayBackend
    from leantrain.settings import load_settings

    start = time.monotonic()
    with pytest.raises(
        LeantrainError,
        match=r"distributed.ray_learner_resource 'gpu-box'.*"
        r"offered: learner, rollout",
    ):
        run_group(print, (), ranks=1, resource="gpu-box", timeout_s=600)
    cfg = load_settings(
        RLConfig,
        None,
        **{
            "orchestrator.mode": "async",
            "orchestrator.backend": "ray",
            "orchestrator.ray_rollout_resource": "rolout",
        },
    )
    with pytest.raises(LeantrainError, match=r"orchestrator\.ray_rollout_resource 'rolout'"):
        RayBackend(cfg, None)
    assert time.monotonic() - start < 10


def test_rollout_workers_start_only_on_the_rollout_node(cluster) -> None:
    from leantrain.rl.config import RLConfig
    from leantrain.rl.ray_backend import RayBackend
    from leantrain.settings import load_settings

    cfg = load_settings(
        RLConfig,
        None,
        **{
            "device": "cpu",
            "orchestrator.mode": "async",
            "orchestrator.backend": "ray",
            "orchestrator.rollout_workers": 2,
            "orchestrator.ray_rollout_resource": "rollout",
        },
    )
    pool = RayBackend(cfg, None)
    try:
        for slot in range(2):
            pool.start(slot)
        deadline = time.monotonic() + 120
        while not all(map(pool.ready, range(2))):  # each imports torch, loads the tiny model
            assert time.monotonic() < deadline, "the workers never became ready"
            time.sleep(0.2)
        time.sleep(0.1)  # the ready callback records the node
        assert pool.nodes == {f"ray-worker-{s}.{s + 1}": cluster["rollout"] for s in range(2)}
    finally:
        pool.shutdown()


def _run_config(cluster, out: Path, **settings) -> RLConfig:
    from leantrain.rl.config import RLConfig
    from leantrain.settings import load_settings

    return load_settings(
        RLConfig,
        None,
        **{
            "out": out,
            "device": "cpu",
            "task.eval_size": 2,
            "sampling.max_new_tokens": 16,
            "grpo.prompts_per_step": 2,
            "grpo.group_size": 2,
            "orchestrator.ray_address": cluster["address"],
            "distributed.ray_learner_resource": "learner",
            "distributed.timeout_s": 60.0,
            **settings,
        },
    )


def test_grpo_run_with_its_learner_on_the_learner_node_and_workers_on_the_rollout_node(
    cluster, tmp_path: Path
) -> None:
    from leantrain.rl.ray_placement import run_learner_group

    cfg = _run_config(
        cluster,
        tmp_path / "run",
        **{
            "steps": 6,
            "orchestrator.mode": "async",
            "orchestrator.backend": "ray",
            "orchestrator.ray_rollout_resource": "rollout",
            "orchestrator.timeout_s": 60.0,
        },
    )
    (placed,) = run_learner_group(cfg)
    summary = placed.value
    assert placed.node_id == cluster["learner"]
    assert summary["steps"] == 6 and summary["backend"] == "ray"
    # A worker that booted before the run ended did so on the rollout node (on 2 busy cores a
    # 6-step run may end first; the test above waits for the workers).
    assert set(summary["rollout_nodes"].values()) <= {cluster["rollout"]}
    assert (cfg.out / "checkpoints").is_dir()


def test_two_learner_ranks_train_on_the_learner_node_with_async_workers(
    cluster, tmp_path: Path
) -> None:
    from leantrain.rl.ray_placement import run_learner_group

    cfg = _run_config(
        cluster,
        tmp_path / "run",
        **{
            "steps": 2,
            "distributed.ray_learner_ranks": 2,
            "orchestrator.mode": "async",
            "orchestrator.backend": "ray",
            "orchestrator.ray_rollout_resource": "rollout",
            "orchestrator.timeout_s": 60.0,
        },
    )
    placed = run_learner_group(cfg)
    assert [p.node_id for p in placed] == [cluster["learner"]] * 2
    summary = placed[0].value  # rank 0 reports
    assert summary["steps"] == 2 and summary["backend"] == "ray" and placed[1].value == {}
    # Rank 0 placed its rollout actors on the rollout node (if one booted before the end).
    assert set(summary["rollout_nodes"].values()) <= {cluster["rollout"]}
    assert len((cfg.out / "metrics.jsonl").read_text().splitlines()) == 2
    shards = {p.name for p in (cfg.out / "checkpoints" / "step-000002").glob("__*.distcp")}
    assert shards == {"__0_0.distcp", "__1_0.distcp"}  # each rank wrote its own
