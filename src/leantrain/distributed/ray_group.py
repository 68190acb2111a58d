"""Placing a group of ranks on a Ray cluster: one Ray actor per rank, all on nodes that offer a
custom resource (`ray start --resources '{"learner": 1}'`), each given torchrun's environment
(RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) before it calls the
function it runs; that function joins the process group as under torchrun
(`process_group.join`). The ranks are one placement group, packed onto as few nodes as fit, so
they are scheduled all together or not at all.

The resource is a node's label, not a count: each rank takes a thousandth of it, so a node that
offers `{"learner": 1}` takes any number of ranks (on GPUs each rank also takes one GPU, which
does count). A resource no node offers is refused at once, naming the setting; a group that
does not fit within `timeout_s` is refused after it, never left pending.

Knows nothing about what the ranks compute; Ray is imported only when a group starts.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from leantrain.distributed.launch import free_port
from leantrain.errors import LeantrainError

# Of the placement resource each rank or worker takes (Ray counts custom resources to 1e-4).
SHARE = 0.001


@dataclass(frozen=True)
class Placed:
    """Where a rank ran and what its function returned.

    Attributes:
        rank: 0..size-1.
        node_id: the Ray node's id (hex).
        ip: the node's address; rank 0's is the group's MASTER_ADDR.
        value: the function's return value.
    """

    rank: int
    node_id: str
    ip: str
    value: Any


class _Rank:
    """The body of one rank's actor."""

    def where(self) -> tuple[str, str]:
        import ray

        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()

    def port(self) -> int:
        return free_port()

    def run(self, env: dict[str, str], fn: Callable[..., Any], args: Sequence[Any]) -> Any:
        os.environ.update(env)
        return fn(*args)


def import_ray(setting: str) -> Any:
    """The `ray` module, or a named error saying how to install it."""
    try:
        import ray
    except ImportError:
        raise LeantrainError(f"{setting} needs Ray: pip install 'ray>=2.9'") from None
    return ray


def connect(address: str | None) -> Any:
    """Ray, connected to the cluster at `address` ("auto": the one this node belongs to; None:
    a new local Ray), unless the caller has connected already."""
    ray = import_ray("Ray placement")
    if not ray.is_initialized():
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        if address is None:
            ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
        else:
            ray.init(address=address, log_to_driver=False)
    return ray


def check_resource(ray: Any, resource: str, setting: str) -> None:
    """Raise a `LeantrainError` naming `setting` when no node of the cluster offers `resource`."""
    offered = ray.cluster_resources()
    if offered.get(resource, 0) > 0:
        return
    custom = sorted(
        k
        for k in offered
        if not k.startswith("node:") and k not in _BUILT_IN and "_group_" not in k
    )
    raise LeantrainError(
        f"{setting} {resource!r}: no node of the Ray cluster offers that resource (custom "
        f"resources offered: {', '.join(custom) or 'none'}); start the node meant for it with "
        f"`ray start ... --resources '{{\"{resource}\": 1}}'`"
    )


_BUILT_IN = {"CPU", "GPU", "memory", "object_store_memory", "accelerator_type"}


def gpus_each(ray: Any, device: str, resource: str | None) -> int:
    """1 when each placed actor computes on a GPU (`device: cuda`, or `auto` with a GPU on a
    node that offers `resource`; None: on any node of the cluster), else 0."""
    if device != "auto":
        return int(device == "cuda")
    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    return int(any(r.get("GPU", 0) > 0 for r in nodes if resource is None or r.get(resource, 0)))


def run_group(
    fn: Callable[..., Any],
    args: Sequence[Any],
    *,
    ranks: int,
    resource: str,
    timeout_s: float,
    gpus_per_rank: int = 0,
    setting: str = "distributed.ray_learner_resource",
) -> list[Placed]:
    """Run `fn(*args)` on `ranks` Ray actors placed on nodes offering `resource`, each with
    torchrun's environment; wait for all of them and return what each returned, by rank.

    Ray must be connected (`connect`). `timeout_s` bounds the placement and the actors' start,
    not `fn`: a rank whose `fn` raises, or whose process dies, ends the group at once (the others
    are killed) with a `LeantrainError` naming that rank.
    """
    ray = import_ray(setting)
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    if ranks < 1:
        raise LeantrainError(f"a Ray group needs at least one rank, got {ranks}")
    check_resource(ray, resource, setting)
    bundle: dict[str, float] = {resource: SHARE}
    if gpus_per_rank:
        bundle["GPU"] = gpus_per_rank
    group = placement_group([bundle] * ranks, strategy="PACK")
    actors: list[Any] = []
    try:
        try:
            ray.get(group.ready(), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise LeantrainError(
                f"{setting} {resource!r}: {ranks} ranks"
                + (f" of {gpus_per_rank} GPU each" if gpus_per_rank else "")
                + f" found no room on the nodes offering it within {timeout_s:g} s"
            ) from None
        remote = ray.remote(num_cpus=0, num_gpus=gpus_per_rank)(_Rank)
        actors = [
            remote.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    group, placement_group_bundle_index=r
                )
            ).remote()
            for r in range(ranks)
        ]
        where = ray.get([a.where.remote() for a in actors], timeout=timeout_s)
        port = ray.get(actors[0].port.remote(), timeout=timeout_s)
        nodes = [node for node, _ in where]
        refs = [
            actor.run.remote(_env(r, nodes, where[0][1], port, gpus_per_rank), fn, args)
            for r, actor in enumerate(actors)
        ]
        values = _wait_all(ray, refs)
        return [Placed(r, where[r][0], where[r][1], values[r]) for r in range(ranks)]
    finally:
        for actor in actors:
            ray.kill(actor, no_restart=True)
        remove_placement_group(group)


def _env(rank: int, nodes: list[str], master: str, port: int, gpus: int) -> dict[str, str]:
    """Torchrun's variables for `rank`; local ranks count the ranks on its node in rank order.
    A rank holding a GPU sees only that one (Ray sets CUDA_VISIBLE_DEVICES), as `cuda:0`, so its
    LOCAL_RANK, which `join` uses as the device index, is 0."""
    local = nodes[:rank].count(nodes[rank])
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(len(nodes)),
        "LOCAL_RANK": "0" if gpus else str(local),
        "LOCAL_WORLD_SIZE": str(nodes.count(nodes[rank])),
        "MASTER_ADDR": master,
        "MASTER_PORT": str(port),
    }


def _wait_all(ray: Any, refs: list[Any]) -> list[Any]:
    """Every rank's result, by rank; the first rank to fail ends the wait with its error."""
    pending = list(refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        try:
            ray.get(done[0])
        except ray.exceptions.RayError as e:
            rank = refs.index(done[0])
            if isinstance(e, ray.exceptions.ActorDiedError):  # Ray's own account follows
                first = "its process died"
            else:  # the rank's exception, whose last line is its message
                cause = getattr(e, "cause", None) or e
                first = (str(cause).strip().splitlines() or [type(cause).__name__])[-1]
            raise LeantrainError(f"rank {rank} of {len(refs)} failed: {first}") from e
    return ray.get(refs)
