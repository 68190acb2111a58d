"""Async RL on vLLM (`orchestrator.mode: async`, `rollout.backend: vllm`, `orchestrator.backend:
process` or `ray`): a spawned worker or a Ray actor holds its own vLLM engine and loads each
published version between batches, so every token of a batch carries that batch's version, as
vLLM's own weight-version spans report it, and each token's behaviour logprob is what a fresh
trainer forward of that version gives; a short k=1 GRPO run trains with staleness at most 1 and
events that tile; a vLLM actor that keeps dying ends the run with an error naming it; a partial
run on a worker process resumes its segments on each version offered to it, every token's
logprob its version's. What async on vLLM does not run yet is refused by name, and a policy made
in memory is saved for vLLM once per run folder, however many processes need it. On a launched
`vllm serve` (`rollout.backend: vllm_server`) a thread, process or Ray worker holds the server
and keeps the same guarantees, read from the server's weight-version spans; async needs a
server per worker; a partial run (a thread or a process worker) loads versions into the server
mid-batch and trains on mixed-version trajectories whose every token's logprob is its
version's.

The run goes in a child interpreter (tests/support/rl_runs.py run as a script): the trainer's own
vLLM engine must not share a process with the engines other test modules start and free (an
engine started after one is freed fails). Tests that need vllm skip where it is not installed
and fail where `CI` is set, as in tests/generation/test_vllm_backend.py; the Ray tests likewise
need ray (tests/rl/test_rollout_events.py).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import rl_runs
import torch
from rl_events import batch_versions, check_events
from rl_runs import run_steps

from leantrain.rl.config import RLConfig, RolloutConfig
from leantrain.settings import load_settings

STEPS = 5
PROMPTS, GROUP = 4, 4
# fp32 on both sides: as tests/generation/test_vllm_backend.py holds vLLM to the trainer.
LOGPROB_TOL = 2e-4


def _config(out: Path, mode: str, steps: int = STEPS, backend: str = "process") -> RLConfig:
    workers = {"orchestrator.backend": backend, "orchestrator.max_staleness": 1}
    return load_settings(
        RLConfig,
        None,
        **{
            "model.name": "tiny",
            "steps": steps,
            "out": out,
            "device": "cpu",
            "task.eval_size": 2,
            "sampling.max_new_tokens": 48,
            "grpo.prompts_per_step": PROMPTS,
            "grpo.group_size": GROUP,
            "grpo.lr": 1e-3,
            "checkpoint_every": 100,
            "rollout.backend": "vllm",
            "rollout.vllm_max_model_len": 512,
            "orchestrator.mode": mode,
            "orchestrator.timeout_s": 300.0,
            **(workers if mode != "sync" else {}),
        },
    )


def run_in_child(cfg: RLConfig) -> list[dict[str, Any]]:
    """`run_steps(cfg)` in a fresh interpreter (see the module doc)."""
    done = start_child(cfg)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return json.loads((cfg.out / "steps.json").read_text())


def start_child(cfg: RLConfig, crash: list[tuple[int, int]] = ()) -> subprocess.CompletedProcess:
    """Run tests/support/rl_runs.py as a script on `cfg`, its workers exiting (a process's
    death) after generating each (batch, attempt) in `crash`; the finished child."""
    cfg.out.mkdir(parents=True, exist_ok=True)
    (cfg.out / "config.json").write_text(cfg.model_dump_json())
    (cfg.out / "crash.json").write_text(json.dumps(crash))
    return subprocess.run(
        [sys.executable, rl_runs.__file__, str(cfg.out)],
        capture_output=True,
        text=True,
        timeout=900,
    )


def check_async_run(cfg: RLConfig, steps: list[dict[str, Any]], worker: str) -> None:
    """What every async run on vLLM keeps, with batches after the first from `worker`'s
    workers: finite losses; staleness at most 1; every token of every trajectory on its batch's
    version, with the behaviour logprob of that version (and not of version 0, whose weights
    the engine started from: a later batch's were published into it); events that tile, every
    sequence's spans on its batch's version (vLLM servers report no per-sequence times: their
    runs' events have the tracks' spans only)."""
    records = [json.loads(line) for line in (cfg.out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, cfg.steps + 1))
    for r, s in zip(records, steps, strict=True):
        assert math.isfinite(r["loss"]) and r["grad_norm"] >= 0  # 0: every group tied
        assert r["staleness_max"] <= 1 and r["mixed_version_trajectories"] == 0
        # Every token of every trajectory carries its batch's version (vLLM's spans, checked
        # against the version the worker loaded, rl/rollout.py `sampled_versions`).
        assert s["versions"] == [[r["batch_version"]]] * (PROMPTS * GROUP)
        assert s["logprob_gap"] < LOGPROB_TOL, (r["batch_worker"], s["logprob_gap"])
        if r["batch_version"] > 0:  # the engine sampled on published weights, not its folder's
            assert s["gap_to_v0"] > 100 * LOGPROB_TOL, (r["batch_worker"], s["gap_to_v0"])
    assert sum(r["grad_norm"] > 0 for r in records) >= cfg.steps - 1  # it trains
    workers = {r["batch_worker"] for r in records[1:]}
    assert any(w.startswith(f"{worker}-0.") for w in workers), workers
    # events.jsonl: every track tiles its time; each sequence's spans carry its batch version.
    events = [json.loads(line) for line in (cfg.out / "events.jsonl").read_text().splitlines()]
    server = cfg.rollout.backend == "vllm_server"
    seqs = check_events(events, steps=cfg.steps, size=0 if server else PROMPTS * GROUP)
    assert any(e["track"].startswith(f"{worker}-0.") and e["name"] == "generate" for e in events)
    if server:
        return
    assert any(track.startswith(f"{worker}-0.") for track, _, _ in seqs)
    versions = batch_versions(seqs)
    assert versions == {b: {r["batch_version"]} for b, r in enumerate(records)}


@pytest.mark.slow  # a worker process imports vllm and starts an engine: ~30-60 s on 2 cores
def test_async_k1_on_vllm_trains_each_batch_on_one_exact_version(
    tiny_path: Path, tmp_path: Path, vllm_installed: None
) -> None:
    cfg = _config(tmp_path / "async", "async")
    check_async_run(cfg, run_in_child(cfg), "process-worker")


@pytest.mark.slow  # a Ray actor imports vllm and starts an engine: ~30-40 s on 2 cores
@pytest.mark.xdist_group("ray")  # with the other Ray tests: tests/distributed/test_ray_group.py
def test_async_k1_on_vllm_ray_actors_trains_each_batch_on_one_exact_version(
    tiny_path: Path, tmp_path: Path, vllm_installed: None, ray_installed: None
) -> None:
    cfg = _config(tmp_path / "ray", "async", steps=3, backend="ray")
    check_async_run(cfg, run_in_child(cfg), "ray-worker")


@pytest.mark.slow  # two Ray actors import vllm and start an engine, one after the other: ~50 s
@pytest.mark.xdist_group("ray")  # with the other Ray tests: tests/distributed/test_ray_group.py
def test_a_vllm_actor_that_keeps_dying_ends_the_run_with_an_error_naming_it(
    tiny_path: Path, tmp_path: Path, vllm_installed: None, ray_installed: None
) -> None:
    cfg = _config(tmp_path / "dead", "async", steps=3, backend="ray")
    cfg.orchestrator.max_restarts = 1
    # Batch 1 kills its actor's process every time; the trainer waits for it (run_steps).
    done = start_child(cfg, crash=[(1, attempt) for attempt in (1, 2, 3)])
    assert done.returncode != 0
    error = done.stderr.strip().splitlines()[-1]
    # (torch prefixes it with `[rank0]: `: vLLM leaves a one-rank process group in the trainer.)
    assert "leantrain.errors.LeantrainError: rollout worker 0 died on batch 1" in error, error
    assert "ray-worker-0.2 exited: The actor died" in error, error
    assert "giving up after 1 worker restarts (orchestrator.max_restarts)" in error


@pytest.fixture(scope="module")
def server(tiny_path: Path, vllm_installed: None, tmp_path_factory: pytest.TempPathFactory):
    """One `vllm serve` on the tiny preset for the module's server-mode runs."""
    from leantrain.generation.vllm_server import launch_server

    log = tmp_path_factory.mktemp("server") / "vllm-serve.log"
    with launch_server(tiny_path, dtype="float32", max_model_len=512, log=log) as srv:
        yield srv


def _server_config(out: Path, url: str, backend: str, mode: str = "async") -> RLConfig:
    cfg = _config(out, mode, steps=3, backend=backend)
    cfg.rollout = RolloutConfig(backend="vllm_server", vllm_urls=[url])
    return cfg


# The tests on `server` share one pytest worker (`make test`: --dist loadgroup): one launch.
SERVER_GROUP = pytest.mark.xdist_group("vllm-serve-async")


@pytest.mark.slow  # a launched vllm serve (25-40 s on 2 cores), then 3 steps
@SERVER_GROUP
@pytest.mark.parametrize(
    ("backend", "worker"),
    [("local", "worker"), ("process", "process-worker"), ("ray", "ray-worker")],
)
def test_async_k1_on_a_vllm_server_trains_each_batch_on_one_exact_version(
    server: Any, tmp_path: Path, backend: str, worker: str, request: pytest.FixtureRequest
) -> None:
    """The worker (a thread, a spawned process or a Ray actor) holds the server while it runs:
    every batch is its own, the trainer generates none and publishes nothing into the server
    until the workers stop, then the server holds the last version (the final evaluation's)."""
    if backend == "ray":
        request.getfixturevalue("ray_installed")
    cfg = _server_config(tmp_path / backend, server.url, backend)
    steps = run_steps(cfg)  # in this process: no engine lives in it, the worker talks HTTP
    check_async_run(cfg, steps, worker)
    records = [json.loads(line) for line in (cfg.out / "metrics.jsonl").read_text().splitlines()]
    assert all(r["batch_worker"].startswith(f"{worker}-0.") for r in records)
    # The worker published versions 0 and 1 or 2 into its own folder; the trainer's client,
    # after the run, the last (3) into its.
    weights = cfg.out / "vllm-server-weights"
    assert sorted(p.name for p in weights.iterdir()) == ["v3", "worker-0"]
    import httpx

    assert httpx.get(f"{server.url}/weight_info", trust_env=False).json() == {"weight_version": "3"}


def check_partial_run(
    cfg: RLConfig, steps: list[dict[str, Any]], worker: str, trajectories: int
) -> None:
    """What every partial run on vLLM keeps, its batches after the first from `worker`'s
    workers: each token carries a version never below its batch's start nor more than k above
    it, staleness stays within k, every token's behaviour logprob is a fresh trainer forward's
    of that version, and updates did land in the middle of a response."""
    records = [json.loads(line) for line in (cfg.out / "metrics.jsonl").read_text().splitlines()]
    k = cfg.orchestrator.max_staleness
    assert [r["step"] for r in records] == list(range(1, cfg.steps + 1))
    assert all(r["batch_worker"].startswith(f"{worker}-0.") for r in records[1:])
    for r, s in zip(records, steps, strict=True):
        assert math.isfinite(r["loss"]) and r["staleness_max"] <= k
        v = r["batch_version"]
        assert all(set(vs) <= set(range(v, v + k + 1)) for vs in s["versions"]), (v, s)
        assert len(s["versions"]) == trajectories
        assert s["logprob_gap"] < LOGPROB_TOL, s["logprob_gap"]
    mixed = [r["mixed_version_trajectories"] for r in records]
    print(f"partial on {worker}: trajectories with two versions per step {mixed}")
    assert sum(mixed) > 0  # updates did land mid-response


@pytest.mark.slow  # a vLLM engine in the trainer and one in a worker process: ~60 s on 2 cores
def test_partial_on_vllm_worker_processes_resumes_segments_on_each_version(
    tiny_path: Path, tmp_path: Path, vllm_installed: None
) -> None:
    """Partial mode on an in-process vLLM engine of a worker process: the batch decodes in
    segments, each a `generate` on the version loaded last (offered to the process while the
    batch runs; the reload resets the prefix cache, so resumed rows re-prefill on the new
    weights). vLLM's own version record of each segment is checked against the version loaded,
    and every token's logprob is its version's."""
    cfg = _config(tmp_path / "partial-vllm", "partial", steps=4)
    # k = 2: the worker never waits for weights, so publishes land in its batches.
    cfg.orchestrator.max_staleness, cfg.orchestrator.segment_tokens = 2, 8
    check_partial_run(cfg, run_in_child(cfg), "process-worker", PROMPTS * GROUP)


@pytest.mark.slow  # a launched vllm serve (shared with the tests above), then 7 steps
@SERVER_GROUP
@pytest.mark.parametrize(
    ("backend", "worker"), [("local", "worker"), ("process", "process-worker")]
)
def test_partial_on_a_vllm_server_loads_each_version_mid_batch_with_exact_token_versions(
    server: Any, tmp_path: Path, backend: str, worker: str
) -> None:
    """Partial mode on a server: the worker (a thread, or a spawned process offered each
    version while its batch runs) decodes each batch in one call and loads every version the
    trainer publishes meanwhile into the server (pause, reload, resume). Each token carries the
    version its span names, within k of the batch's, staleness stays within k, and every
    token's behaviour logprob is a fresh trainer forward's of that version."""
    cfg = _server_config(tmp_path / f"partial-{backend}", server.url, backend, mode="partial")
    # k = 2: the worker runs ahead (batches 0-2 on version 0), then starts each batch on the
    # version just published, so the next lands in it whenever the batch decodes longer than
    # a step trains. A batch lasts as long as its longest response and a step as all its
    # tokens: a long budget (128; the model's longest responses reach it) tips that way, and
    # 7 steps give it 4 batches to happen in (a process worker, sharing no GIL with the
    # trainer, mixed 1 batch of 2 in a 5-step run).
    cfg.steps, cfg.orchestrator.max_staleness = 7, 2
    cfg.sampling = cfg.sampling.model_copy(update={"max_new_tokens": 128})
    check_partial_run(cfg, run_steps(cfg), worker, PROMPTS * GROUP)


def test_async_on_vllm_servers_needs_a_server_per_worker(tmp_path: Path, monkeypatch) -> None:
    from leantrain.errors import LeantrainError
    from leantrain.generation import vllm_server
    from leantrain.rl.rollout import vllm_server_backend

    def config(urls: list[str], placed: int = 0) -> RLConfig:
        return load_settings(
            RLConfig,
            None,
            **{
                "out": tmp_path,
                "rollout.backend": "vllm_server",
                "rollout.vllm_urls": urls,
                "rollout.vllm_ray_servers": placed,
                "orchestrator.mode": "async",
                "orchestrator.rollout_workers": 2,
            },
        )

    with pytest.raises(LeantrainError, match=r"rollout_workers is 2 but rollout.vllm_urls has 1"):
        config(["http://127.0.0.1:1"])
    # Servers the run places on Ray count as URLs do (their URLs fill vllm_urls at set-up).
    with pytest.raises(
        LeantrainError, match=r"rollout_workers is 2 but rollout.vllm_ray_servers is 1"
    ):
        config([], placed=1)
    config([], placed=2)
    cfg = config(["http://127.0.0.1:1", "http://127.0.0.1:2", "http://h:3"])
    # Worker i of n takes URLs i, i + n, ... and a folder of its own: no server is shared,
    # none is left out; the trainer's client is on every server.
    made: list[tuple[list[str], Path]] = []
    published: list[tuple[list[str], int]] = []

    class Client:  # records what the servers would be sent
        def __init__(self, urls: list[str], **kw: Any) -> None:
            self.urls = urls
            made.append((urls, kw["weights_dir"]))

        def load_weights(self, weights: dict[str, torch.Tensor], version: int) -> None:
            published.append((self.urls, version))

    monkeypatch.setattr(vllm_server, "VLLMServerBackend", Client)
    model = torch.nn.Linear(2, 2)
    for worker in (0, 1, None):
        vllm_server_backend(cfg, model, worker)
    root = tmp_path / "vllm-server-weights"
    assert made == [
        (["http://127.0.0.1:1", "http://h:3"], root / "worker-0"),
        (["http://127.0.0.1:2"], root / "worker-1"),
        (cfg.rollout.vllm_urls, root),
    ]
    # Only the trainer's client publishes the set-up weights (version 0), to every server: the
    # run evaluates on them before its first step, whatever the servers held before.
    assert published == [(cfg.rollout.vllm_urls, 0)]


def test_vllm_refuses_what_async_on_it_does_not_run_yet(tmp_path: Path) -> None:
    from leantrain.errors import LeantrainError, NotBuiltError
    from leantrain.rl.rollout import refuse_unsupported
    from leantrain.tasks import make_task

    task = make_task("arith")
    example = task.examples(1, 0)[0]
    cfg = _config(tmp_path, "async")
    for backend in ("process", "ray"):  # async on worker processes and Ray actors is built
        cfg.orchestrator.backend = backend
        refuse_unsupported(cfg, task, example)
    cfg.orchestrator.mode = "partial"  # so is partial, whose segments reload between calls
    for backend in ("process", "ray"):
        cfg.orchestrator.backend = backend
        refuse_unsupported(cfg, task, example)
    cfg.orchestrator.backend = "local"
    for mode in ("async", "partial"):
        cfg.orchestrator.mode = mode
        with pytest.raises(NotBuiltError, match=rf"{mode} .*process or ray only.*trainer's") as no:
            refuse_unsupported(cfg, task, example)
        assert isinstance(no.value, LeantrainError)  # the CLI prints it on one line


def test_the_trainer_and_workers_share_one_saved_policy_folder(tmp_path: Path, monkeypatch) -> None:
    """A policy made in memory is saved for vLLM once per run folder: the trainer and every
    worker process come to `vllm_backend`, the first rename wins, no staging folder is left,
    and a folder of another model (an earlier run there) is replaced."""
    from leantrain.generation import vllm_backend
    from leantrain.models import load_model
    from leantrain.rl.rollout import rollout_backend
    from leantrain.tasks import make_task

    made: list[Path] = []
    monkeypatch.setattr(vllm_backend, "vllm_available", lambda: True)
    monkeypatch.setattr(vllm_backend, "VLLMBackend", lambda folder, **kw: made.append(folder))
    cfg = _config(tmp_path / "run", "async")
    model, tok = load_model(cfg.model.name)
    model.name_or_path = "made-in-memory"
    folder = cfg.out / "vllm-policy"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")  # another model's
    for _ in range(2):  # the trainer, then a worker
        rollout_backend(cfg, model, tok, make_task("arith"))
    assert made == [folder, folder]
    saved = load_model(folder)[0].state_dict()
    assert saved.keys() == model.state_dict().keys()
    assert [p.name for p in cfg.out.iterdir()] == ["vllm-policy"]
