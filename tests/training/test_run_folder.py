"""The run folder every trainer opens: a fresh folder is set up, a used one is refused (naming
--resume only where the run can resume), a resume drops the records past the resumed step."""

from __future__ import annotations

from pathlib import Path

import pytest

from leantrain.errors import LeantrainError
from leantrain.training.run_folder import RunFolder


def _steps(path: Path) -> list[int]:
    return [r["step"] for r in RunFolder.open(path, resume=True).metrics.read()]


def test_a_fresh_folder_is_created_with_its_sinks(tmp_path: Path) -> None:
    folder = RunFolder.open(tmp_path / "a" / "run")
    assert folder.path.is_dir()
    assert folder.metrics.path == tmp_path / "a" / "run" / "metrics.jsonl"
    assert folder.completions.path == tmp_path / "a" / "run" / "completions.jsonl"
    assert folder.checkpoints == tmp_path / "a" / "run" / "checkpoints"
    assert folder.last_checkpoint() is None
    # Opening writes no record: the same folder opens again while nothing has been logged.
    assert RunFolder.open(tmp_path / "a" / "run").last_checkpoint() is None


@pytest.mark.parametrize("resumable", [True, False])
def test_a_folder_with_metrics_is_refused(tmp_path: Path, resumable: bool) -> None:
    RunFolder.open(tmp_path).metrics.write({"step": 1, "loss": 2.0})
    with pytest.raises(LeantrainError, match="already holds a run") as error:
        RunFolder.open(tmp_path, resumable=resumable)
    assert str(tmp_path) in str(error.value) and "choose another --out" in str(error.value)
    assert ("--resume" in str(error.value)) == resumable


def test_a_complete_checkpoint_alone_holds_a_run_and_a_partial_one_does_not(
    tmp_path: Path,
) -> None:
    (tmp_path / "checkpoints" / "step-000002.partial").mkdir(parents=True)
    assert RunFolder.open(tmp_path).last_checkpoint() is None  # an interrupted write: no run
    (tmp_path / "checkpoints" / "step-000001").mkdir()
    with pytest.raises(LeantrainError, match="already holds a run"):
        RunFolder.open(tmp_path)


def test_resume_keeps_the_records_up_to_the_step_and_finds_the_newest_checkpoint(
    tmp_path: Path,
) -> None:
    folder = RunFolder.open(tmp_path)
    for step in (1, 2, 3, 4):
        folder.metrics.write({"step": step, "loss": 1.0 / step})
        folder.completions.write({"step": step, "response": f"r{step}"})
    for name in ("step-000001", "step-000002", "step-000004.partial"):
        (folder.checkpoints / name).mkdir(parents=True)
    resumed = RunFolder.open(tmp_path, resume=True)
    assert resumed.last_checkpoint() == folder.checkpoints / "step-000002"
    resumed.truncate_after(2)
    assert _steps(tmp_path) == [1, 2]
    assert [r["response"] for r in resumed.completions.read()] == ["r1", "r2"]
    assert resumed.metrics.read()[1] == {"step": 2, "loss": 0.5}


def test_resume_drops_the_events_of_the_batches_that_run_again(tmp_path: Path) -> None:
    folder = RunFolder.open(tmp_path)
    assert folder.events is not None
    spans = [{"track": "trainer", "name": "start", "t0": 0.0, "t1": 1.0}]
    spans += [{"track": "trainer", "name": "train", "batch": b, "t0": b, "t1": b} for b in range(4)]
    folder.events.write(spans)
    resumed = RunFolder.open(tmp_path, resume=True)
    resumed.truncate_after(2)  # steps 1-2 trained on batches 0-1; batches 2-3 run again
    kept = resumed.events.sink.read()
    assert [r.get("batch") for r in kept] == [None, 0, 1]


def test_events_can_be_switched_off(tmp_path: Path) -> None:
    from leantrain.telemetry.config import TelemetryConfig

    assert RunFolder.open(tmp_path, telemetry=TelemetryConfig(events=False)).events is None
