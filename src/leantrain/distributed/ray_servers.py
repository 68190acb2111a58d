"""vLLM servers placed by Ray: `place_servers` starts `count` `vllm serve` processes on a Ray
cluster, one Ray actor each, and returns them as `RayServers`, whose `urls` are what a
`VLLMServerBackend` talks to (generation/vllm_server.py) and whose `stop` ends them.

- Where: on nodes that offer a custom resource (`ray start --resources '{"vllm": 1}'`; a label,
  as in distributed/ray_group.py: each server takes a thousandth of it), or on any node. Each
  server takes one GPU where those nodes have GPUs (Ray sets the actor's CUDA_VISIBLE_DEVICES,
  which the server inherits), else one CPU. The servers are one placement group, spread over
  the nodes as far as they go: all placed or none, refused after `timeout_s`, never pending.
- What each serves: the policy folder, read at the same path on its node: the same machine, or
  a filesystem every node shares (a folder the node cannot read is refused by name).
- Where it listens: 127.0.0.1 by default, so it answers its own machine only, and the client
  (this process) must run on the same node: checked once the group is placed, before any server
  starts. `host="node"` binds the node's address as Ray knows it, and the URL uses it: for a
  cluster of several machines, on a network trusted with the servers' unauthenticated routes.
- How long: a server never outlives its actor. `ray.kill`, and the death of the actor's owner
  (a driver that dies takes its actors with it), end the actor's process without running its
  code; Ray then at most kills the actor's direct children (RAY_kill_child_processes_on_worker_
  exit), never theirs, so a server started by the actor would run on, or leave its engine
  process behind. So the actor starts a guardian instead (this module run as a script): it
  detaches (forks; the actor reaps the parent, so the guardian is nobody's child Ray kills),
  starts the server with `launch_server`, and reads its stdin, a pipe whose only writing end the
  actor holds. However the actor's process ends, the kernel closes that end: the guardian reads
  EOF and stops the server with `LocalServer.close` (its process group, the engine process
  included), then exits. `RayServers.stop` takes the same path and waits for it.

The error messages name the `rollout.vllm_ray_*` settings that feed it (rl/rollout.py); it knows
nothing else of runs. Ray is imported only when servers are placed.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from leantrain.distributed.ray_group import (
    SHARE,
    check_resource,
    connect,
    gpus_each,
    import_ray,
)
from leantrain.errors import LeantrainError
from leantrain.generation.vllm_server import LocalServer, VLLMServerError, launch_server

if TYPE_CHECKING:  # the annotation only: peft is imported where a LoRA server starts
    from peft import LoraConfig

# The guardian's stop (LocalServer.close: SIGTERM, then SIGKILL after 30 s) and exit.
_STOP_S = 60.0
_SILENT = (
    "its guardian exited without a report (its traceback is in the Ray worker's log on that node)"
)


@dataclass(frozen=True)
class PlacedServer:
    """One placed server.

    Attributes:
        url: its base URL.
        node_id: the Ray node's id (hex).
        ip: the node's address.
        pid: the server's process id on that node, the leader of its process group (its
            engine process is in the group).
        log: its output, a file on that node.
    """

    url: str
    node_id: str
    ip: str
    pid: int
    log: str


class _Server:
    """The body of one server's actor: it holds the writing end of its guardian's stdin."""

    def __init__(self) -> None:
        self.guardian: subprocess.Popen | None = None

    def start(self, spec: dict[str, Any]) -> PlacedServer:
        import ray

        node, ip = ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()
        if not (Path(spec["model"]) / "config.json").is_file():
            raise LeantrainError(
                f"rollout.vllm_ray_servers: the policy folder {spec['model']} is not readable on "
                f"node {ip}: the servers read it at the same path, so run on one machine or put "
                "the run folder (and model.name) on a filesystem every node shares"
            )
        spec = {**spec, "host": ip if spec["host"] == "node" else spec["host"]}
        # The actor's import path (a Ray runtime env may have set it) is the guardian's, so it
        # imports this same leantrain.
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self.guardian = subprocess.Popen(
            [sys.executable, "-m", "leantrain.distributed.ray_servers", json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        self.guardian.wait()  # the parent of the fork, which exits at once (`_guard`)
        assert self.guardian.stdout is not None
        # Bounded: `launch_server` gives up after its timeout, and the guardian then answers.
        line = self.guardian.stdout.readline()
        report = json.loads(line) if line else {"error": _SILENT}
        if "error" in report:
            raise VLLMServerError(f"vllm serve on node {ip}: {report['error']}")
        return PlacedServer(report["url"], node, ip, report["pid"], report["log"])

    def stop(self) -> None:
        """Close the guardian's stdin, so it stops the server, and wait (at most `_STOP_S`)
        until it has exited."""
        if self.guardian is None:
            return
        assert self.guardian.stdin is not None and self.guardian.stdout is not None
        self.guardian.stdin.close()
        _wait_closed(self.guardian.stdout, _STOP_S)


def _wait_closed(stream: IO[bytes], timeout_s: float) -> None:
    """Wait until `stream`'s writer closes it (EOF: the guardian has exited), at most
    `timeout_s`; what is read is dropped."""
    fd = stream.fileno()
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        if select.select([fd], [], [], left)[0] and not os.read(fd, 4096):
            return


class RayServers:
    """Servers placed by `place_servers`; `stop` ends them.

    Attributes:
        servers: each server, in placement order.
    """

    def __init__(self, ray: Any, group: Any, connected: bool) -> None:
        self._ray = ray
        self._group = group
        self._connected = connected  # Ray was connected before: not ours to shut down
        self._actors: list[Any] = []
        self._starts: list[Any] = []  # each actor's `start` call
        self.servers: list[PlacedServer] = []

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]

    def stop(self) -> None:
        """Stop every started server and wait for it (at most a minute), then kill the actors,
        free the placement and, if `place_servers` connected to Ray, disconnect. A server still
        starting, or not stopped within the minute, is stopped by its guardian once its actor
        is gone. Calling it again does nothing."""
        ray = self._ray
        if ray is None:
            return
        from ray.util.placement_group import remove_placement_group

        try:
            # An actor runs one call at a time: a `stop` behind a `start` would wait for it.
            stops = [
                actor.stop.remote()
                for actor, start in zip(self._actors, self._starts, strict=True)
                if ray.wait([start], timeout=0)[0]
            ]
            if stops:
                ray.wait(stops, num_returns=len(stops), timeout=_STOP_S + 10)
        finally:
            for actor in self._actors:
                ray.kill(actor, no_restart=True)
            remove_placement_group(self._group)
            if not self._connected:
                ray.shutdown()
            self._ray = None


def place_servers(
    model: str | Path,
    *,
    count: int,
    resource: str | None,
    host: str,
    timeout_s: float,
    log_dir: str | Path,
    address: str | None = None,
    dtype: str = "auto",
    max_model_len: int | None = None,
    kv_cache_gib: float = 1.0,
    enforce_eager: bool = True,
    seed: int = 0,
    lora: LoraConfig | None = None,
    weight_transfer: str = "files",
) -> RayServers:
    """Start `count` vLLM servers on the Hugging Face folder `model`, one Ray actor each, on
    nodes offering `resource` (None: any node), bound to `host` ("127.0.0.1", or "node": the
    node's address), and wait until every one answers `/health`.

    Connects to the Ray cluster at `address` (None: a new local Ray) unless connected already.
    `timeout_s` bounds the placement and then the servers' start; `dtype` "auto" is vLLM's
    choice on GPUs and float32 on CPU; server i writes its output to `log_dir/server-i.log` on
    its node. `lora` (a peft `LoraConfig`): servers for a LoRA policy's adapters;
    `weight_transfer` "nccl": servers that take weights over NCCL (`launch_server`). A server
    that fails to start, a placement that does not fit and a resource no node offers raise a
    `LeantrainError` naming the setting (a failed server's with its last log lines); nothing
    placed is left running then.
    """
    ray = import_ray("rollout.vllm_ray_servers")
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    connected = ray.is_initialized()
    connect(address)
    if resource is not None:
        try:
            check_resource(ray, resource, "rollout.vllm_ray_resource")
        except LeantrainError:
            if not connected:
                ray.shutdown()
            raise
    gpus = gpus_each(ray, "auto", resource)
    bundle = {"GPU": 1.0} if gpus else {"CPU": 1.0}
    if resource is not None:
        bundle[resource] = SHARE
    servers = RayServers(ray, placement_group([bundle] * count, strategy="SPREAD"), connected)
    try:
        _wait_placed(ray, servers._group, count, resource, gpus, timeout_s)
        if host == "127.0.0.1":
            _check_local(ray, servers._group)
        remote = ray.remote(
            num_cpus=0 if gpus else 1,
            num_gpus=gpus,
            resources=None if resource is None else {resource: SHARE},
        )(_Server)
        servers._actors = [
            remote.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    servers._group, placement_group_bundle_index=i
                )
            ).remote()
            for i in range(count)
        ]
        spec = {
            "model": str(model),
            "host": host,
            "dtype": dtype if dtype != "auto" or gpus else "float32",
            "max_model_len": max_model_len,
            "kv_cache_gib": kv_cache_gib,
            "enforce_eager": enforce_eager,
            "seed": seed,
            "timeout_s": timeout_s,
            # peft's config as JSON (its target-module set as a sorted list), rebuilt by `_guard`.
            "weight_transfer": weight_transfer,
            "lora": None
            if lora is None
            else json.loads(json.dumps(lora.to_dict(), default=sorted)),
        }
        servers._starts = [
            actor.start.remote({**spec, "log": str(Path(log_dir) / f"server-{i}.log")})
            for i, actor in enumerate(servers._actors)
        ]
        # The guardian's own wait is `timeout_s`; its stop after a failed start, a minute more.
        servers.servers = _wait_started(ray, servers._starts, timeout_s + _STOP_S + 10)
        return servers
    except BaseException:
        servers.stop()
        raise


def _wait_placed(
    ray: Any, group: Any, count: int, resource: str | None, gpus: int, timeout_s: float
) -> None:
    try:
        ray.get(group.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        where = f"the nodes offering {resource!r}" if resource else "the Ray cluster"
        raise LeantrainError(
            f"rollout.vllm_ray_servers {count}: {count} server(s) of one {'GPU' if gpus else 'CPU'}"
            f" each found no room on {where} within {timeout_s:g} s "
            "(rollout.vllm_ray_timeout_s); use fewer servers, or nodes with room for them"
        ) from None


def _check_local(ray: Any, group: Any) -> None:
    """Refuse servers bound to 127.0.0.1 placed on another machine than this process's."""
    from ray.util.placement_group import placement_group_table

    here = ray.util.get_node_ip_address()
    address = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    nodes = placement_group_table(group)["bundles_to_node_id"].values()
    elsewhere = sorted({address[n] for n in nodes} - {here})
    if elsewhere:
        raise LeantrainError(
            f"rollout.vllm_ray_host 127.0.0.1: servers placed on {', '.join(elsewhere)} would "
            f"answer their own machine only, and this run's client is on {here}; set "
            "rollout.vllm_ray_host: node (each binds its node's address), or place them here"
        )


def _wait_started(ray: Any, refs: list[Any], timeout_s: float) -> list[PlacedServer]:
    """Every server's placement, in order; the first to fail ends the wait with its error."""
    pending = list(refs)
    deadline = time.monotonic() + timeout_s
    while pending:
        done, pending = ray.wait(pending, num_returns=1, timeout=deadline - time.monotonic())
        if not done:
            raise LeantrainError(
                f"rollout.vllm_ray_servers: {len(pending)} of {len(refs)} server(s) did not "
                f"report within {timeout_s:g} s (their logs: rollout.vllm_ray_timeout_s "
                "bounds their start)"
            )
        try:
            ray.get(done[0])
        except ray.exceptions.RayError as e:
            i = refs.index(done[0])
            cause = getattr(e, "cause", None) or e
            raise LeantrainError(f"rollout.vllm_ray_servers: server {i}: {cause}") from e
    return ray.get(refs)


def _guard(spec: dict[str, Any]) -> None:
    """The guardian (module doc): detach, start the server, report it as one JSON line on
    stdout, and stop it once stdin reaches EOF."""
    if os.fork():
        os._exit(0)  # the actor reaps this parent; the child is no child of the actor's
    os.setsid()  # nor in its process group: a signal to that group does not reach it
    log = Path(spec["log"])
    log.parent.mkdir(parents=True, exist_ok=True)
    try:
        server: LocalServer = launch_server(
            spec["model"],
            host=spec["host"],
            dtype=spec["dtype"],
            max_model_len=spec["max_model_len"],
            kv_cache_gib=spec["kv_cache_gib"],
            seed=spec["seed"],
            enforce_eager=spec["enforce_eager"],
            timeout_s=spec["timeout_s"],
            log=log,
            lora=None if spec["lora"] is None else _lora_config(spec["lora"]),
            weight_transfer=spec["weight_transfer"],
        )
    except LeantrainError as e:
        print(json.dumps({"error": str(e)}), flush=True)
        return
    try:  # also when the report finds the actor gone (a broken pipe): the server goes too
        print(json.dumps({"url": server.url, "pid": server.process.pid, "log": str(log)}))
        sys.stdout.flush()
        sys.stdin.buffer.read()  # until the actor's end closes: `stop`, or its process ended
    finally:
        server.close()


def _lora_config(fields: dict[str, Any]) -> LoraConfig:
    from peft import LoraConfig

    return LoraConfig(**fields)


if __name__ == "__main__":
    _guard(json.loads(sys.argv[1]))
