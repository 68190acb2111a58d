"""Trackers: a tiny `leantrain rl` run reports to TensorBoard, W&B, MLflow and trackio offline,
and each library's own reader gives back metrics.jsonl's scalars, the completions table and the
config; the run folder fans out for every trainer (ZO shown); a tracker that cannot start or that
fails later is one warning and the run goes on."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, ClassVar

import pytest

from leantrain.telemetry import trackers
from leantrain.telemetry.config import TelemetryConfig
from leantrain.telemetry.trackers import flatten, scalars
from leantrain.training.run_folder import RunFolder

LIBRARIES = {
    "tensorboard": "tensorboard",
    "wandb": "wandb",
    "mlflow": "mlflow",
    "trackio": "trackio",
}
CHECKED = ("reward", "accuracy", "loss", "response_len_max", "train_s")


def need_libraries() -> None:
    missing = [m for m in LIBRARIES.values() if importlib.util.find_spec(m) is None]
    if missing:
        message = f"needs {missing} (pip install 'leantrain[trackers]')"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)


@pytest.mark.slow  # one tiny run in a subprocess that starts four trackers (~30 s)
def test_each_tracker_reads_back_the_runs_scalars_table_and_config(
    tiny_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    need_libraries()
    out = tmp_path / "run"
    env = {
        **os.environ,
        "TRACKIO_DIR": str(tmp_path / "trackio"),  # trackio's local database
        "WANDB_DATA_DIR": str(tmp_path / "wandb-data"),  # W&B's staging, off the home folder
        "WANDB_CACHE_DIR": str(tmp_path / "wandb-cache"),
        "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"),
        "OMP_NUM_THREADS": "1",
    }
    overrides = {
        "telemetry.report_to": "[tensorboard, wandb, mlflow, trackio]",
        "telemetry.table_every": "1",
        "telemetry.run_name": "tiny-run",
        "task.eval_size": "2",
        "sampling.max_new_tokens": "16",
        "grpo.prompts_per_step": "2",
        "grpo.group_size": "2",
        "log_completions": "1",
    }
    leantrain = str(Path(sys.executable).parent / "leantrain")
    command = [leantrain, "rl", "--model", "tiny", "--steps", "2", "--device", "cpu"]
    command += ["--threads", "1", "--out", str(out)]
    for key, value in overrides.items():
        command += ["-o", f"{key}={value}"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "did not start" not in done.stderr and "failed in" not in done.stderr, done.stderr
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    expected = {(r["step"], k): r[k] for r in records for k in CHECKED}
    prompts = [json.loads(line)["prompt"] for line in (out / "completions.jsonl").open()]
    assert len(prompts) == 2

    # TensorBoard: the event file, through TensorBoard's own EventAccumulator.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(out / "tensorboard" / "tiny-run"))
    board.Reload()
    got = {(e.step, k): e.value for k in CHECKED for e in board.Scalars(k)}
    assert got == pytest.approx(expected, rel=1e-6)  # float32 in the event file
    tables = [
        t.tensor_proto.string_val[0].decode() for t in board.Tensors("completions/text_summary")
    ]
    assert len(tables) == 2 and prompts[0].splitlines()[0] in tables[0]
    assert "_hparams_/session_start_info" in board.PluginTagToContent("hparams")

    # W&B offline: the run's .wandb log, read by W&B's own inspector.
    (log,) = (out / "wandb").glob("offline-run-*/run-*.wandb")
    wandb = str(Path(sys.executable).parent / "wandb")
    inspected = _stdout([wandb, "leet", "inspect", "--json", str(log)], env)
    history = [
        r["history"] for r in map(json.loads, inspected.splitlines()) if r["type"] == "history"
    ]
    got = {(h["step"]["num"], k): h["item"][k] for h in history for k in CHECKED if k in h["item"]}
    assert got == pytest.approx(expected)
    tables = [h for h in history if h["item"].get("completions._type") == "table-file"]
    assert [h["step"]["num"] for h in tables] == [1, 2]
    table = json.loads((log.parent / "files" / tables[0]["item"]["completions.path"]).read_text())
    assert table["columns"][:2] == ["step", "prompt"] and table["data"][0][1] == prompts[0]
    run_record = next(r for r in map(json.loads, inspected.splitlines()) if r["type"] == "run")
    assert run_record["run"]["config"]["update"]["grpo"]["group_size"] == 2

    # MLflow: the file store under the run folder, through MlflowClient.
    from mlflow import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 asks to open a file store
    client = MlflowClient(tracking_uri=(out / "mlruns").resolve().as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("leantrain").experiment_id])
    got = {
        (m.step, k): m.value for k in CHECKED for m in client.get_metric_history(run.info.run_id, k)
    }
    assert got == pytest.approx(expected)
    assert run.data.params["grpo.group_size"] == "2" and run.info.status == "FINISHED"
    tables = [a.path for a in client.list_artifacts(run.info.run_id, "completions")]
    assert tables == ["completions/step_000001.json", "completions/step_000002.json"]

    # trackio: its local database, through its own storage reader.
    read = "from trackio.sqlite_storage import SQLiteStorage as S; import json;"
    reader = _stdout(
        [sys.executable, "-c", f"{read} print(json.dumps(S.get_logs('leantrain', 'tiny-run')))"],
        env,
    )
    logs = json.loads(reader.splitlines()[-1])
    got = {(r["step"], k): r[k] for r in logs for k in CHECKED if k in r}
    assert got == pytest.approx(expected)
    assert sum("completions" in r for r in logs) == 2


def _stdout(command: list[str], env: dict[str, str]) -> str:
    return subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=120, check=True
    ).stdout


class Recorder:
    """A tracker that keeps what it was sent."""

    runs: ClassVar[list[Recorder]] = []

    def __init__(self, run: trackers.TrackerRun) -> None:
        self.run = run
        self.calls: list[tuple[str, Any, Any]] = []
        Recorder.runs.append(self)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        self.calls.append(("scalars", step, values))

    def table(self, step: int, columns: list[str], rows: list[list[Any]]) -> None:
        self.calls.append(("table", step, (columns, rows)))

    def close(self) -> None:
        self.calls.append(("close", None, None))


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> type[Recorder]:
    Recorder.runs = []
    monkeypatch.setitem(trackers.TRACKERS, "tensorboard", Recorder)
    return Recorder


def test_the_run_folder_fans_out_scalars_tables_and_params(recorder, tmp_path: Path) -> None:
    config = TelemetryConfig(report_to=["tensorboard"], table_every=2)
    folder = RunFolder.open(tmp_path / "run", telemetry=config, params={"grpo": {"lr": 0.1}})
    for step in (1, 2, 3):
        folder.completions.write({"step": step, "prompt": f"p{step}", "rewards": {"answer": 1.0}})
        folder.metrics.write({"step": step, "loss": 1.0 / step, "lengths": [1, 2], "ok": True})
    folder.close()
    (tracker,) = recorder.runs
    assert tracker.run.name == "run" and tracker.run.params == {"grpo": {"lr": 0.1}}
    assert json.loads((tmp_path / "run" / "config.json").read_text()) == {"grpo": {"lr": 0.1}}
    columns = ["step", "prompt", "rewards"]
    assert tracker.calls == [
        ("scalars", 1, {"loss": 1.0}),  # numbers only: no list, no bool, no step
        ("table", 2, (columns, [[1, "p1", '{"answer": 1.0}'], [2, "p2", '{"answer": 1.0}']])),
        ("scalars", 2, {"loss": 0.5}),
        ("scalars", 3, {"loss": 1 / 3}),
        ("table", 3, (columns, [[3, "p3", '{"answer": 1.0}']])),  # the rest, at close
        ("close", None, None),
    ]


def test_zo_reports_to_the_trackers_with_no_code_of_its_own(recorder, tiny_path, tmp_path) -> None:
    from leantrain.settings import load_settings
    from leantrain.zo.config import ZOConfig
    from leantrain.zo.run import ZORun

    cfg = load_settings(
        ZOConfig,
        "configs/tiny-zo.yaml",
        **{
            "model.name": "tiny",
            "steps": 2,
            "out": tmp_path / "zo",
            "device": "cpu",
            "task.train_size": 8,
            "task.eval_size": 4,
            "save": "none",
            "telemetry.report_to": ["tensorboard"],
        },
    )
    ZORun(cfg, progress=False).run()
    (tracker,) = recorder.runs
    sent = [(step, values["loss"]) for kind, step, values in tracker.calls if kind == "scalars"]
    logged = [
        (r["step"], r["loss"]) for r in map(json.loads, (tmp_path / "zo" / "metrics.jsonl").open())
    ]
    assert sent == logged and len(sent) == 2
    assert tracker.run.params["zo"]["estimator"] == cfg.zo.estimator
    assert tracker.calls[-1][0] == "close"


def test_a_tracker_that_cannot_start_is_one_warning_and_the_run_goes_on(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed
    config = TelemetryConfig(report_to=["wandb", "mlflow"], mlflow_tracking_uri="nosuch://host")
    with caplog.at_level(logging.WARNING, logger="leantrain.telemetry.trackers"):
        folder = RunFolder.open(tmp_path, telemetry=config)
        folder.metrics.write({"step": 1, "loss": 2.0})
        folder.close()
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2
    assert "wandb did not start (ModuleNotFoundError" in warnings[0]
    assert "pip install 'leantrain[wandb]'" in warnings[0]
    assert warnings[1].startswith("telemetry.report_to: mlflow did not start")
    assert folder.metrics.read() == [{"step": 1, "loss": 2.0}]


def test_a_tracker_that_fails_later_is_dropped_with_one_warning(
    recorder, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    def broken(self, step: int, values: dict[str, float]) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(Recorder, "scalars", broken)
    folder = RunFolder.open(tmp_path, telemetry=TelemetryConfig(report_to=["tensorboard"]))
    with caplog.at_level(logging.WARNING, logger="leantrain.telemetry.trackers"):
        for step in (1, 2, 3):
            folder.metrics.write({"step": step, "loss": 1.0})
        folder.close()
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "tensorboard failed in scalars (OSError: disk full)" in warning
    assert len(folder.metrics.read()) == 3 and recorder.runs[0].calls == []  # dropped: no close


def test_params_flatten_and_scalars_keep_finite_numbers() -> None:
    assert flatten({"a": {"b": 1, "c": [1, 2]}, "d": None, "e": "x"}) == {
        "a.b": 1,
        "a.c": "[1, 2]",
        "d": "null",
        "e": "x",
    }
    assert scalars({"step": 3, "x": 1, "y": float("nan"), "z": True, "w": "t", "v": 2.5}) == {
        "x": 1.0,
        "v": 2.5,
    }


def test_report_to_names_each_tracker_once() -> None:
    from leantrain.errors import LeantrainError

    with pytest.raises(LeantrainError, match="report_to"):
        TelemetryConfig(report_to=["wandb", "wandb"])
    with pytest.raises(LeantrainError, match="report_to"):
        TelemetryConfig(report_to=["neptune"])
