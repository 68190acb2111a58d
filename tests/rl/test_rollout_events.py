"""events.jsonl of real runs in every mode and worker kind (sync, async threads, partial, worker
processes, Ray actors, multi-turn episodes): every track's spans tile its time, every sequence's
spans tile its life and nest in its worker's `generate` span of its batch, every batch's every
sequence is there once, the trainer's track covers the run, and versions are the ones sampled."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from rl_events import batch_versions, check_events

from leantrain.rl.config import RLConfig
from leantrain.rl.episodes import EpisodeRunner
from leantrain.rl.grpo import GRPORun
from leantrain.rl.orchestrator import Orchestrator
from leantrain.settings import load_settings
from leantrain.tasks.tool_arith import ToolCall

PROMPTS, GROUP, STEPS = 2, 3, 3


def _config(tmp_path: Path, name: str, path: str | None = None, **overrides: Any) -> RLConfig:
    settings = {
        "model.name": "tiny",
        "steps": STEPS,
        "out": tmp_path / name,
        "device": "cpu",
        "task.eval_size": 2,
        "sampling.max_new_tokens": 24,
        "grpo.prompts_per_step": PROMPTS,
        "grpo.group_size": GROUP,
        "checkpoint_every": 100,
        **overrides,
    }
    return load_settings(RLConfig, path, **settings)


def _events(run: GRPORun) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run.out / "events.jsonl").read_text().splitlines()]


def test_a_sync_run_records_the_trainers_rollouts(tiny_path: Path, tmp_path: Path) -> None:
    run = GRPORun(_config(tmp_path, "sync"), progress=False)
    summary = run.run()
    seqs = check_events(_events(run), STEPS, PROMPTS * GROUP)
    assert {track for track, _, _ in seqs} == {"trainer"}
    assert batch_versions(seqs) == {b: {b} for b in range(STEPS)}  # batch n is sampled on version n
    assert summary["seconds_events"] > 0


@pytest.mark.parametrize("mode", ["async", "partial"])
def test_thread_workers_record_their_spans(mode: str, tiny_path: Path, tmp_path: Path) -> None:
    cfg = _config(
        tmp_path,
        mode,
        **{
            "orchestrator.mode": mode,
            "orchestrator.max_staleness": 1,
            "orchestrator.segment_tokens": 8,
        },
    )
    run = GRPORun(cfg, progress=False)
    run.run()
    events = _events(run)
    seqs = check_events(events, STEPS, PROMPTS * GROUP)
    assert {track for track, _, _ in seqs} == {"worker-0.1"}
    worker = {s["name"] for s in events if s["track"] == "worker-0.1" and "seq" not in s}
    assert {"start", "idle", "generate", "score"} <= worker
    for batch, versions in batch_versions(seqs).items():  # bounded staleness, seen per span
        assert versions <= {batch - 1, batch}
    if mode == "partial":  # segments: sequences wait between them, re-queued on newer weights
        assert any(s["name"] == "wait" for spans in seqs.values() for s in spans)


@dataclass
class EchoTool:
    """A tool environment the tiny model uses untaught: every line is a call, answered "ok"."""

    max_turns: int = 3
    episode_tokens: int = 40
    tool_stop: str = "\n"
    multi_turn: bool = True

    def call_tool(self, turn_text: str) -> ToolCall:
        return ToolCall(code=turn_text, outcome="ok", output="ok")


def test_multi_turn_episodes_record_turns_and_tool_calls(tiny_path: Path, tmp_path: Path) -> None:
    cfg = _config(tmp_path, "tools", "configs/tiny-tools.yaml", max_cache_tokens=256)
    run = GRPORun(cfg, progress=False)
    run.source.backend = EpisodeRunner(run.source.backend.engine, EchoTool())
    run.run()
    seqs = check_events(
        _events(run), STEPS, PROMPTS * GROUP
    )  # one sequence per episode, however many turns
    names = [s["name"] for spans in seqs.values() for s in spans]
    assert names.count("tool") > 0 and names.count("prefill") > names.count("finish")


@pytest.mark.slow  # a worker process or actor starts (imports torch): ~10-20 s
def test_worker_processes_send_their_events_with_their_batches(
    worker_backend: str, tiny_path: Path, tmp_path: Path
) -> None:
    cfg = _config(
        tmp_path,
        worker_backend,
        **{
            "orchestrator.mode": "async",
            "orchestrator.backend": worker_backend,
            "orchestrator.max_staleness": 1,
            "orchestrator.timeout_s": 60.0,
        },
    )
    run = GRPORun(cfg, progress=False)
    events = run.folder.events
    with Orchestrator(run.config, run.learner, run.source, run.log_step, events=events) as o:
        o.step()  # the worker still starts: the trainer generates batch 0 itself
        deadline = time.monotonic() + 60
        while not o.pool.ready(0):
            assert time.monotonic() < deadline, "the worker never became ready"
            time.sleep(0.1)
        while run.step < cfg.steps:
            o.step()
    seqs = check_events(_events(run), STEPS, PROMPTS * GROUP)
    tracks = {track for track, _, _ in seqs}
    assert "trainer" in tracks and any(t.startswith(f"{worker_backend}-worker-0.") for t in tracks)
