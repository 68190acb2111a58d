"""What a run reports besides its run folder: the trackers it fans its metrics out to
(telemetry/trackers.py) and whether it records rollout events (telemetry/events.py). Every
trainer's settings (GRPO, ZO, tune) carry one as `telemetry`."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from leantrain.settings import Strict

TrackerName = Literal["tensorboard", "wandb", "mlflow", "trackio"]


class TelemetryConfig(Strict):
    report_to: list[TrackerName] = Field(
        default_factory=list,
        description="Trackers that get the same scalars as metrics.jsonl, the sampled "
        "completions as a table and the config as run parameters: any of tensorboard, wandb, "
        "mlflow, trackio (each an extra: pip install 'leantrain[wandb]'). Each costs its "
        "library's start-up (1-6 s) and a little time per step; one that fails to start is "
        "one warning and the run goes on. Empty: the run folder only.",
    )
    offline: bool = Field(
        True,
        description="Trackers write only to this machine: W&B in offline mode under "
        "RUN/wandb (upload later with `wandb sync`), MLflow to a file store under RUN/mlruns "
        "(unless mlflow_tracking_uri is set), TensorBoard under RUN/tensorboard, trackio to its "
        "local database (TRACKIO_DIR). False: W&B online (needs `wandb login`).",
    )
    project: str = Field(
        "leantrain",
        min_length=1,
        description="W&B and trackio project, MLflow experiment the runs are grouped under.",
    )
    run_name: str | None = Field(
        None, description="The run's name in the trackers (None: the run folder's name)."
    )
    mlflow_tracking_uri: str | None = Field(
        None,
        description="Where MLflow logs (any MLflow URI: sqlite:///mlflow.db, http://host:5000). "
        "None: a file store in RUN/mlruns, readable by `mlflow ui --backend-store-uri "
        "RUN/mlruns` with no server running meanwhile.",
    )
    table_every: int = Field(
        10,
        ge=1,
        description="Steps between completions tables sent to the trackers (each holds the "
        "completions sampled since the last one). Small: finer history, more tracker files.",
    )
    events: bool = Field(
        True,
        description="Write events.jsonl (GRPO runs): every sequence's queue, prefill, decode "
        "and speculation spans with their policy version, and the workers' and trainer's "
        "spans, for `leantrain view`. Costs well under 1% of a tiny run's time and about "
        "80 kB per 128 sequences on disk.",
    )

    @field_validator("report_to")
    @classmethod
    def _each_once(cls, value: list[str]) -> list[str]:
        if len(set(value)) != len(value):
            raise ValueError(f"each tracker at most once, got {value}")
        return value
