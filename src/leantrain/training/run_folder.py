"""A run's output folder, set up the same way by every trainer (GRPO, ZO, SFT): the folder, its
`metrics.jsonl` and `completions.jsonl` sinks, the `checkpoints/` folder, and either a resume
(the JSONL records past the resumed step are dropped: those steps run again) or a refusal of a
folder that already holds a run, so a new run never appends to an old one's records.

    folder = RunFolder.open(out, resume=resume, resumable=True, telemetry=cfg.telemetry,
                            params=cfg.model_dump(mode="json"))
    if resume:
        step = restore(folder.last_checkpoint())  # the trainer's own state (None: from scratch)
        folder.truncate_after(step)
    ...
    folder.close()  # the trackers finish (also at exit, for a run that never gets here)

The metrics and completions sinks fan out to the trackers of `telemetry.report_to`
(telemetry/trackers.py), so every trainer that writes its records here reports to them with no
code of its own; the config is written as `config.json` and sent to them as parameters.

Knows nothing about what is trained or what a checkpoint holds (`training.checkpoint`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from leantrain.errors import LeantrainError
from leantrain.telemetry import JsonlSink
from leantrain.telemetry.config import TelemetryConfig
from leantrain.telemetry.events import EventLog
from leantrain.telemetry.trackers import Trackers
from leantrain.training.checkpoint import list_checkpoints


@dataclass(frozen=True)
class RunFolder:
    """The paths and sinks of one run's folder.

    Attributes:
        path: the folder itself (summary, plots and models go beside the sinks).
        metrics: one JSON line per step.
        completions: sampled completions, one JSON line each, with their step.
        checkpoints: where checkpoints go (`training.checkpoint`; created by the first one).
        events: rollout events (`events.jsonl`, written by the RL loop), None when
            `telemetry.events` is off.
        trackers: the trackers the sinks fan out to (none by default).
    """

    path: Path
    metrics: JsonlSink
    completions: JsonlSink
    checkpoints: Path
    events: EventLog | None
    trackers: Trackers

    @classmethod
    def open(
        cls,
        path: Path,
        *,
        resume: bool = False,
        resumable: bool = False,
        telemetry: TelemetryConfig | None = None,
        params: Mapping[str, Any] | None = None,
    ) -> RunFolder:
        """Create `path` if needed and return its run folder.

        Args:
            path: the run folder (`--out`).
            resume: continue the run the folder holds (the caller restores its checkpoint and
                calls `truncate_after`); without it a folder that holds a run (metrics or a
                complete checkpoint) is refused with a LeantrainError.
            resumable: the kind of run can resume (`--resume`): the refusal says so.
            telemetry: the trackers to report to and whether to record events (default: none,
                and events on).
            params: the run's config as JSON-able values, written to `config.json` and sent
                to the trackers as parameters.
        """
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        metrics, completions = path / "metrics.jsonl", path / "completions.jsonl"
        if not resume and (metrics.exists() or last_checkpoint(path / "checkpoints")):
            hint = "pass --resume to continue it or " if resumable else ""
            raise LeantrainError(
                f"run folder {path} already holds a run; {hint}choose another --out"
            )
        telemetry = telemetry or TelemetryConfig()
        params = dict(params or {})
        if params:
            (path / "config.json").write_text(json.dumps(params, indent=2, default=str) + "\n")
        trackers = Trackers(telemetry, path, params)
        return cls(
            path=path,
            metrics=JsonlSink(metrics, also=trackers.metrics),
            completions=JsonlSink(completions, also=trackers.completion),
            checkpoints=path / "checkpoints",
            events=EventLog(path / "events.jsonl") if telemetry.events else None,
            trackers=trackers,
        )

    def last_checkpoint(self) -> Path | None:
        """The newest complete checkpoint, None if there is none."""
        return last_checkpoint(self.checkpoints)

    def truncate_after(self, step: int) -> None:
        """Drop the records of steps after `step` from the sinks (on resume: the steps after
        the checkpoint were lost with the crash and will be run and logged again), and the
        events of the batches those steps train on (batch n is trained at step n + 1)."""
        self.metrics.truncate_after(step)
        self.completions.truncate_after(step)
        if self.events is not None:
            self.events.sink.truncate_after(step - 1, key="batch")

    def close(self) -> None:
        """Finish the trackers (their last table, their files)."""
        self.trackers.close()


def last_checkpoint(root: Path) -> Path | None:
    """The newest complete checkpoint under `root`, None if there is none."""
    checkpoints = list_checkpoints(root)
    return checkpoints[-1] if checkpoints else None
