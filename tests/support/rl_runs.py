"""Helpers the RL tests share (on pytest's `pythonpath`): a driver that runs a GRPO run step by
step and records what each step trained on, and the rounding bound between two code paths that
sum in another order.

Run as a script (`python rl_runs.py OUT`), it is the fresh interpreter
tests/rl/test_async_vllm.py starts: it reads OUT/config.json and OUT/crash.json and writes
OUT/steps.json (the trainer's own vLLM engine must not share a process with the engines other
test modules start and free)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from leantrain.rl.config import RLConfig
from leantrain.rl.rollout_worker import FaultPlan


def reordered_sum_tolerance(model_config: object, seq_len: int) -> float:
    """How far one token's fp32 logprob may move between two code paths that compute the same
    sums in another order (the worker decodes in its own batches and buffers, and MKL's kernels
    then split them differently): Higham's worst-case bound for a sum of n terms summed in
    another order, n * eps relative to the terms (logprobs and logits of order 1-10 here), with n
    the longest sum the logprob rests on: attention over the sequence or the MLP's width. For the
    tiny model that is 512 * 1.19e-7 = 6.1e-5; measured drift 1.1e-5 (1 of 32 tokens), while
    other weights or another version move logprobs by 1e-3 and more."""
    width = model_config.intermediate_size  # type: ignore[attr-defined]
    return torch.finfo(torch.float32).eps * max(seq_len, width)


def run_steps(cfg: RLConfig, faults: FaultPlan | None = None) -> list[dict[str, Any]]:
    """Drive `cfg`'s run step by step (in this process, on a small local Ray for `backend:
    ray`; the workers inject `faults`); in async and partial mode, after the first step (the
    trainer's own batch while the worker boots) wait for the worker, so the later batches are
    the worker's.
    One record a step: its wall seconds, each trajectory's set of token versions, and the
    largest gap between a behaviour logprob and a fresh trainer forward of the version that
    sampled it (and of version 0)."""
    if cfg.orchestrator.backend != "ray":
        return _run_steps(cfg, faults)
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        return _run_steps(cfg, faults)
    finally:
        ray.shutdown()


def _run_steps(cfg: RLConfig, faults: FaultPlan | None) -> list[dict[str, Any]]:
    from leantrain.rl.grpo import GRPORun
    from leantrain.rl.orchestrator import Orchestrator

    run = GRPORun(cfg, progress=False)
    seen: list[dict[str, Any]] = []
    trained: list[list[Any]] = []
    published: dict[int, dict[str, Any]] = {}  # version -> its weights, as every engine got them
    publish = run.learner.publish

    def keep_published() -> dict[str, Any]:
        weights = publish()  # a detached copy already: kept as it is
        published[run.learner.version] = weights
        return weights

    def log_step(trajectories, stats, **kw):
        assert all(len(t.versions) == len(t.response_ids) for t in trajectories)
        seen.append({"versions": [sorted(set(t.versions)) for t in trajectories]})
        trained.append(trajectories)
        return run.log_step(trajectories, stats, **kw)

    run.learner.publish = keep_published
    events = run.folder.events
    with Orchestrator(cfg, run.learner, run.source, log_step, faults, events) as o:
        while run.step < cfg.steps:
            t0 = time.perf_counter()
            o.step()
            seen[-1]["step_s"] = time.perf_counter() - t0
            if run.step == 1 and cfg.orchestrator.mode != "sync":
                deadline = time.monotonic() + cfg.orchestrator.timeout_s
                while not o.pool.ready(0):
                    assert time.monotonic() < deadline, "the worker never became ready"
                    time.sleep(0.1)
    for record, trajectories in zip(seen, trained, strict=True):
        record["logprob_gap"] = _logprob_gap(cfg, trajectories, published)
        record["gap_to_v0"] = _logprob_gap(cfg, trajectories, published, on=0)
    return seen


def _logprob_gap(
    cfg: RLConfig, trajectories: list[Any], published: dict[int, Any], on: int | None = None
) -> float:
    """The largest |behaviour logprob - trainer logprob| over `trajectories`' tokens, the
    trainer's from one fresh forward over prompt + response on the weights of version `on`
    (None: the version each token carries: one per trajectory in async mode, one or more in
    partial mode)."""
    from leantrain.models import load_model
    from leantrain.training.logprobs import token_logprobs

    model = load_model(cfg.model.name, dtype="float32")[0].eval()
    gap = 0.0
    for t in trajectories:
        versions = t.versions if on is None else [on] * len(t.versions)
        ids = torch.tensor([t.prompt_ids + t.response_ids])
        for version in sorted(set(versions)):
            model.load_state_dict(published[version])
            with torch.no_grad():
                logits = model(ids).logits[0, len(t.prompt_ids) - 1 : -1]
            trainer = token_logprobs(logits, torch.tensor(t.response_ids), cfg.sampling.temperature)
            at = [i for i, v in enumerate(versions) if v == version]
            gap = max(gap, float((trainer - torch.tensor(t.logprobs))[at].abs().max()))
    return gap


if __name__ == "__main__":  # the child of test_async_vllm.start_child: python this_file OUT
    out = Path(sys.argv[1])
    config = RLConfig.model_validate_json((out / "config.json").read_text())
    crash = frozenset(map(tuple, json.loads((out / "crash.json").read_text())))
    faults = FaultPlan(crash=crash, hard_exit=True) if crash else None
    (out / "steps.json").write_text(json.dumps(run_steps(config, faults)))
