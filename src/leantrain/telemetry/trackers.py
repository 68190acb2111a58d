"""The trackers users already run: TensorBoard, Weights & Biases, MLflow and trackio, each
through its own library. A run folder fans its metrics and completions out to them
(training/run_folder.py), so every loop that writes metrics reports to them with no code of its
own: each tracker gets the numbers of every metrics.jsonl record as scalars at its step, the
sampled completions as a table every `table_every` steps, and the run's config as parameters.

A tracker whose library is missing or that fails to start costs one warning and the run goes on
without it; one that fails later (a full disk, a lost server) is dropped with one warning too.
Offline by default: W&B offline mode, an MLflow file store, TensorBoard event files (all under
the run folder) and trackio's local database.

Knows nothing about what is trained: records are plain JSON objects with a `step`.
"""

from __future__ import annotations

import atexit
import json
import logging
import math
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from leantrain.telemetry.config import TelemetryConfig

log = logging.getLogger(__name__)


class Tracker(Protocol):
    """One tracker's side of a run."""

    def scalars(self, step: int, values: dict[str, float]) -> None:
        """Log `values` at `step`."""

    def table(self, step: int, columns: list[str], rows: list[list[Any]]) -> None:
        """Log the sampled completions as a table at `step`."""

    def close(self) -> None:
        """Finish the tracker's run (flush its files)."""


@dataclass(frozen=True)
class TrackerRun:
    """What a tracker is told when it starts: the run folder, the run's name, its parameters
    (the config, nested) and the telemetry settings."""

    folder: Path
    name: str
    params: Mapping[str, Any]
    config: TelemetryConfig


def flatten(params: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested parameters as one level of dotted keys; lists and None as text."""
    flat: dict[str, Any] = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten(value, f"{name}."))
        elif isinstance(value, (bool, int, float, str)):
            flat[name] = value
        else:
            flat[name] = json.dumps(value, default=str)
    return flat


def scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """The finite numbers of a metrics record, `step` aside (lists and text are not scalars)."""
    return {
        k: float(v)
        for k, v in record.items()
        if k != "step"
        and isinstance(v, (int, float))
        and not isinstance(v, bool)
        and math.isfinite(v)
    }


class _TensorBoard:
    def __init__(self, run: TrackerRun) -> None:
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        self.writer = SummaryWriter(log_dir=str(run.folder / "tensorboard" / run.name))
        # The hparams plugin's summaries written into the run's own event file (add_hparams
        # would start a second run in a subfolder).
        for summary in hparams(flatten(run.params), {}):
            self.writer.file_writer.add_summary(summary)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)

    def table(self, step: int, columns: list[str], rows: list[list[Any]]) -> None:
        def cell(value: Any) -> str:
            return str(value).replace("|", "\\|").replace("\n", "<br>")

        lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
        self.writer.add_text("completions", "\n".join(lines), step)

    def close(self) -> None:
        self.writer.close()


class _WandB:
    def __init__(self, run: TrackerRun) -> None:
        import wandb

        self.wandb = wandb
        self.run = wandb.init(
            project=run.config.project,
            name=run.name,
            dir=str(run.folder),
            mode="offline" if run.config.offline else "online",
            config=dict(run.params),
            reinit="create_new",  # several runs in one process (tests, sweeps in Python)
            # No stdout capture and no system-metrics sampler: the run's own console and cores.
            settings=wandb.Settings(console="off", silent=True, x_disable_stats=True),
        )

    def scalars(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def table(self, step: int, columns: list[str], rows: list[list[Any]]) -> None:
        self.run.log({"completions": self.wandb.Table(columns=columns, data=rows)}, step=step)

    def close(self) -> None:
        self.run.finish()


class _MLflow:
    def __init__(self, run: TrackerRun) -> None:
        from mlflow import MlflowClient
        from mlflow.entities import Param

        uri = run.config.mlflow_tracking_uri
        if uri is None:
            uri = (run.folder / "mlruns").resolve().as_uri()
            # MLflow 3 refuses a new file store unless asked (it prefers a database); the file
            # store is what needs no server and no database here. A user's own setting wins.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name(run.config.project)
        experiment_id = (
            experiment.experiment_id
            if experiment is not None
            else self.client.create_experiment(run.config.project)
        )
        self.run_id = self.client.create_run(experiment_id, run_name=run.name).info.run_id
        params = [Param(k, str(v)[:6000]) for k, v in flatten(run.params).items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=params[i : i + 100])

    def scalars(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, step) for k, v in values.items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def table(self, step: int, columns: list[str], rows: list[list[Any]]) -> None:
        data = {c: [row[i] for row in rows] for i, c in enumerate(columns)}
        self.client.log_table(self.run_id, data, f"completions/step_{step:06d}.json")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class _Trackio:
    def __init__(self, run: TrackerRun) -> None:
        import trackio

        self.trackio = trackio
        self.run = trackio.init(
            project=run.config.project,
            name=run.name,
            config=dict(run.params),
            auto_log_cpu=False,  # no sampler thread on the run's cores
            auto_log_gpu=False,
        )

    def scalars(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def table(self, step: int, columns: list[str], rows: list[list[Any]]) -> None:
        self.run.log({"completions": self.trackio.Table(columns=columns, data=rows)}, step=step)

    def close(self) -> None:
        self.run.finish()


TRACKERS: dict[str, Callable[[TrackerRun], Tracker]] = {
    "tensorboard": _TensorBoard,
    "wandb": _WandB,
    "mlflow": _MLflow,
    "trackio": _Trackio,
}
# The pip extra that installs each tracker's library.
EXTRAS = {name: f"pip install 'leantrain[{name}]'" for name in TRACKERS}


class Trackers:
    """The trackers of `config.report_to` for one run, fed record by record: `metrics` takes
    each metrics.jsonl record, `completion` each completions.jsonl record (kept until the next
    table is due). `close` (also run at exit, for a run that never reaches its end) sends the
    last table and finishes every tracker.

    Args:
        config: the run's telemetry settings.
        folder: the run folder (trackers that write files write them under it).
        params: the run's config, nested, logged as parameters.
    """

    def __init__(self, config: TelemetryConfig, folder: Path, params: Mapping[str, Any]) -> None:
        self.config = config
        name = config.run_name or Path(folder).resolve().name
        run = TrackerRun(Path(folder), name, params, config)
        self.active: dict[str, Tracker] = {}
        for tracker in config.report_to:
            try:
                self.active[tracker] = TRACKERS[tracker](run)
            except Exception as e:  # any failure: one warning, the run goes on
                hint = f" ({EXTRAS[tracker]})" if isinstance(e, ImportError) else ""
                log.warning(
                    "telemetry.report_to: %s did not start (%s: %s)%s; the run goes on without it",
                    tracker,
                    type(e).__name__,
                    e,
                    hint,
                )
        self._rows: list[dict[str, Any]] = []
        self._next_table = config.table_every
        if self.active:
            atexit.register(self.close)

    def metrics(self, record: Mapping[str, Any]) -> None:
        """Send a metrics record's scalars at its step; the completions table when it is due."""
        step = record.get("step")
        if not self.active or not isinstance(step, int):
            return
        if step >= self._next_table and self._rows:
            self._table(step)
        self._each("scalars", step, scalars(record))

    def completion(self, record: Mapping[str, Any]) -> None:
        """Keep a sampled completion for the next table."""
        if self.active:
            self._rows.append(dict(record))

    def close(self) -> None:
        """Send the completions not yet in a table and finish every tracker."""
        if self._rows:
            self._table(max(int(r.get("step", 0)) for r in self._rows))
        self._each("close")
        self.active.clear()
        atexit.unregister(self.close)

    def _table(self, step: int) -> None:
        columns = list(dict.fromkeys(k for row in self._rows for k in row))
        rows = [[_cell(row.get(c)) for c in columns] for row in self._rows]
        self._each("table", step, columns, rows)
        self._rows = []
        self._next_table = step + self.config.table_every

    def _each(self, method: str, *args: Any) -> None:
        for name, tracker in list(self.active.items()):
            try:
                getattr(tracker, method)(*args)
            except Exception as e:  # a tracker never stops the run
                log.warning(
                    "telemetry.report_to: %s failed in %s (%s: %s); it is dropped for the rest "
                    "of the run",
                    name,
                    method,
                    type(e).__name__,
                    e,
                )
                del self.active[name]


def _cell(value: Any) -> Any:
    """A table cell: numbers, text and None as they are, anything else as JSON text."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return json.dumps(value, default=str)
