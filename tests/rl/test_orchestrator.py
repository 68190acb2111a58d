"""Asynchronous GRPO on the tiny model, local backend: k = 0 is sync, each trajectory keeps one
version, staleness stays within k, nothing is lost or duplicated when workers crash or stall,
long samples are not biased out, a stalled trainer is reported, a killed run resumes."""

from __future__ import annotations

import json
import threading
from collections import Counter
from pathlib import Path

import pytest
from rl_runs import reordered_sum_tolerance

from leantrain.errors import LeantrainError
from leantrain.rl.buffer import StallError
from leantrain.rl.config import RLConfig
from leantrain.rl.grpo import GRPORun
from leantrain.rl.orchestrator import Orchestrator
from leantrain.rl.rollout_worker import FaultPlan
from leantrain.rl.trajectory import Trajectory
from leantrain.settings import load_settings


def _config(tiny_path: Path, out: Path, **overrides: object) -> RLConfig:
    """3 prompts x 2 samples, 32 tokens: a step takes well under a second."""
    return load_settings(
        RLConfig,
        None,
        **{
            "steps": 3,
            "out": out,
            "device": "cpu",
            "task.eval_size": 2,
            "sampling.max_new_tokens": 32,
            "grpo.prompts_per_step": 3,
            "grpo.group_size": 2,
            "grpo.lr": 1e-3,
            "grpo.warmup_steps": 0,
            "orchestrator.timeout_s": 20.0,
            **overrides,
        },
    )


def _recording(run: GRPORun) -> list[list[Trajectory]]:
    """Make `run` keep every batch it trains on, in order."""
    trained: list[list[Trajectory]] = []
    train_step = run.learner.step

    def keep(trajectories: list[Trajectory], **kwargs: object) -> dict[str, float]:
        trained.append(trajectories)
        return train_step(trajectories, **kwargs)

    run.learner.step = keep  # type: ignore[method-assign]
    return trained


def _run_async(run: GRPORun, faults: FaultPlan | None = None) -> dict:
    """`run.run()`, but with faults injected into the orchestrator's workers."""
    with Orchestrator(run.config, run.learner, run.source, run.log_step, faults) as orchestrator:
        while run.step < run.config.steps:
            orchestrator.step()
        return orchestrator.summary()


def test_staleness_zero_gives_the_sync_trajectories(tiny_path: Path, tmp_path: Path) -> None:
    sync = GRPORun(_config(tiny_path, tmp_path / "sync"), progress=False)
    sync_batches = _recording(sync)
    sync.run()
    cfg = _config(
        tiny_path,
        tmp_path / "k0",
        **{"orchestrator.mode": "async", "orchestrator.max_staleness": 0},
    )
    k0 = GRPORun(cfg, progress=False)
    k0_batches = _recording(k0)
    summary = k0.run()
    assert summary["max_observed_staleness"] == 0 and summary["mode"] == "async"
    assert len(sync_batches) == len(k0_batches) == 3
    for a, b in zip(sync_batches, k0_batches, strict=True):
        assert [t.response_ids for t in a] == [t.response_ids for t in b]
        assert [t.versions for t in a] == [t.versions for t in b]
        for ta, tb in zip(a, b, strict=True):
            tolerance = reordered_sum_tolerance(
                sync.model.config, len(ta.prompt_ids + ta.response_ids)
            )
            assert ta.logprobs == pytest.approx(tb.logprobs, abs=tolerance)


def test_async_keeps_one_version_per_trajectory_and_bounds_staleness(
    tiny_path: Path, tmp_path: Path
) -> None:
    cfg = _config(
        tiny_path,
        tmp_path / "k2",
        **{
            "steps": 5,
            "orchestrator.mode": "async",
            "orchestrator.max_staleness": 2,
            "orchestrator.rollout_workers": 2,
        },
    )
    run = GRPORun(cfg, progress=False)
    trained = _recording(run)
    summary = run.run()
    for step, batch in enumerate(trained):
        for t in batch:
            assert len(set(t.versions)) == 1  # intra-trajectory consistency
            assert 0 <= step - t.versions[0] <= 2  # trainer version at step s is s
    assert 1 <= summary["max_observed_staleness"] <= 2  # it did run ahead
    records = [json.loads(line) for line in (cfg.out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    for key in ("staleness_max", "weight_publish_s", "weight_load_s", "generation_idle_fraction"):
        assert key in records[-1], key
    assert (cfg.out / "metrics.png").exists() and (cfg.out / "summary.json").exists()


def test_crashed_and_stalled_workers_lose_and_duplicate_nothing(
    tiny_path: Path, tmp_path: Path
) -> None:
    cfg = _config(
        tiny_path,
        tmp_path / "faults",
        **{
            "steps": 4,
            "orchestrator.mode": "async",
            "orchestrator.max_staleness": 1,
            "orchestrator.timeout_s": 2.0,
        },
    )
    run = GRPORun(cfg, progress=False)
    trained = _recording(run)
    faults = FaultPlan(crash=frozenset({(1, 1)}), stall=frozenset({(2, 1)}), stall_s=6.0)
    summary = _run_async(run, faults)
    # Every prompt of every step reached the trainer exactly once, in step order.
    prompt_ids = Counter(
        (step, t.group_id) for step, batch in enumerate(trained) for t in batch[::2]
    )
    assert sorted(prompt_ids) == [(s, g) for s in range(4) for g in range(3)]
    assert set(prompt_ids.values()) == {1}
    assert summary["worker_restarts"] == 2
    records = [json.loads(line) for line in (cfg.out / "metrics.jsonl").read_text().splitlines()]
    assert [r["batch_attempt"] for r in records] == [1, 2, 2, 1]


def test_trained_lengths_are_the_generated_lengths(tiny_path: Path, tmp_path: Path) -> None:
    """Admission, not dropping: the long responses are trained, so the trained length
    distribution is exactly the generated one (as multisets), tail included."""
    cfg = _config(
        tiny_path,
        tmp_path / "lengths",
        **{
            "steps": 4,
            "sampling.max_new_tokens": 96,
            "orchestrator.mode": "async",
            "orchestrator.max_staleness": 1,
        },
    )
    run = GRPORun(cfg, progress=False)
    trained = _recording(run)
    generated: list[int] = []
    with Orchestrator(run.config, run.learner, run.source, run.log_step) as orchestrator:
        put = orchestrator.buffer.put
        orchestrator.buffer.put = lambda b: (  # type: ignore[method-assign]
            generated.extend(len(t.response_ids) for t in b.trajectories),
            put(b),
        )[1]
        while run.step < cfg.steps:
            orchestrator.step()
    lengths = sorted(len(t.response_ids) for batch in trained for t in batch)
    assert lengths == sorted(generated)
    assert max(lengths) > 2 * sorted(lengths)[len(lengths) // 2]  # there is a tail to keep


def test_restarts_run_out_with_a_clear_error(tiny_path: Path, tmp_path: Path) -> None:
    cfg = _config(
        tiny_path,
        tmp_path / "dead",
        **{"orchestrator.mode": "async", "orchestrator.max_restarts": 1},
    )
    run = GRPORun(cfg, progress=False)
    faults = FaultPlan(crash=frozenset({(0, 1), (0, 2)}))
    with pytest.raises(LeantrainError, match=r"rollout worker 0 died on batch 0.*giving up"):
        _run_async(run, faults)


def test_a_stalled_trainer_is_reported(tiny_path: Path, tmp_path: Path) -> None:
    cfg = _config(
        tiny_path,
        tmp_path / "slow",
        **{
            "orchestrator.mode": "async",
            "orchestrator.max_staleness": 0,
            "orchestrator.timeout_s": 1.0,
        },
    )
    run = GRPORun(cfg, progress=False)
    train_step = run.learner.step

    def hang_on_step_two(trajectories: list[Trajectory], **kwargs: object) -> dict[str, float]:
        if run.step == 1:
            import time

            time.sleep(3.0)
        return train_step(trajectories, **kwargs)

    run.learner.step = hang_on_step_two  # type: ignore[method-assign]
    with pytest.raises(StallError, match="trainer stalled: training step 2"):
        _run_async(run)


def test_a_killed_run_resumes_from_its_checkpoint(tiny_path: Path, tmp_path: Path) -> None:
    cfg = _config(
        tiny_path,
        tmp_path / "killed",
        **{"steps": 4, "checkpoint_every": 2, "orchestrator.mode": "async"},
    )
    run = GRPORun(cfg, progress=False)
    train_step = run.learner.step

    def die_on_step_four(trajectories: list[Trajectory], **kwargs: object) -> dict[str, float]:
        if run.step == 3:
            raise KeyboardInterrupt  # the process is killed mid-run
        return train_step(trajectories, **kwargs)

    run.learner.step = die_on_step_four  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        run.run()
    resumed = GRPORun(cfg, progress=False, resume=True)
    assert resumed.step == 2 and resumed.version == 2
    summary = resumed.run()
    assert summary["steps"] == 4 and summary["policy_version"] == 4
    records = [json.loads(line) for line in (cfg.out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]


def test_partial_mode_switches_versions_mid_trajectory(tiny_path: Path, tmp_path: Path) -> None:
    cfg = _config(
        tiny_path,
        tmp_path / "partial",
        **{
            "steps": 4,
            "sampling.max_new_tokens": 96,
            "orchestrator.mode": "partial",
            "orchestrator.max_staleness": 1,
            "orchestrator.segment_tokens": 4,
            "orchestrator.off_policy": "tis",
        },
    )
    run = GRPORun(cfg, progress=False)
    trained = _recording(run)
    run.run()
    mixed = 0
    for step, batch in enumerate(trained):
        for t in batch:
            assert t.versions == sorted(t.versions)  # resumed on newer weights, never older
            assert step - t.versions[0] <= 1  # no token older than k
            assert len(t.versions) == len(t.response_ids) == len(t.logprobs)
            mixed += len(set(t.versions)) > 1
    assert mixed > 0  # some in-flight sequences did resume on new weights


def test_unsupported_combinations_are_refused(tiny_path: Path, tmp_path: Path) -> None:
    # Partial runs on every backend (processes and Ray actors are offered each version:
    # tests/rl/test_async_process.py); what no rollout worker does is refused by the config,
    # when it is loaded, naming the fields.
    partial = {"orchestrator.mode": "partial"}
    for backend in ("local", "process", "ray"):
        _config(tiny_path, tmp_path / backend, **partial, **{"orchestrator.backend": backend})
    for field in ("speculative.enabled", "lora.enabled"):
        with pytest.raises(LeantrainError, match=rf"{field} needs orchestrator.mode: sync"):
            _config(tiny_path, tmp_path / "bad", **partial, **{field: True})


def test_async_workers_keep_to_the_kv_budget(
    tiny_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from leantrain.generation import Engine

    cfg = _config(
        tiny_path,
        tmp_path / "kv",
        **{"orchestrator.mode": "async", "orchestrator.rollout_workers": 2},
    )
    run = GRPORun(cfg, progress=False)
    prompts = [run.source.batch(s)[1] for s in range(cfg.steps)]
    longest = max(len(p) for batch in prompts for p in batch)
    budget = longest + cfg.sampling.max_new_tokens  # room for the longest row alone
    # Unbudgeted, a whole batch decodes at once: rows x (its longest prompt + one token) at least.
    assert min(len(b) * (max(map(len, b)) + 1) for b in prompts) > budget
    cfg = cfg.model_copy(update={"max_cache_tokens": budget, "out": tmp_path / "kv-budget"})
    run = GRPORun(cfg, progress=False)
    peaks: list[tuple[str, int]] = []  # (thread, peak cache tokens) of every generate call
    generate = Engine.generate

    def recording(self: Engine, *args: object, **kwargs: object) -> object:
        out = generate(self, *args, **kwargs)
        peaks.append((threading.current_thread().name, self.peak_cache_tokens))
        return out

    monkeypatch.setattr(Engine, "generate", recording)
    run.run()
    in_workers = [peak for thread, peak in peaks if thread.startswith("worker-")]
    assert len(in_workers) >= cfg.steps  # every batch came from a worker
    assert 0 < max(in_workers) <= budget, (budget, in_workers)
