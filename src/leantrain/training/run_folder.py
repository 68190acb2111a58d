"""A run's output folder, set up the same way by every trainer (GRPO, ZO, SFT): the folder, its
`metrics.jsonl` and `completions.jsonl` sinks, the `checkpoints/` folder, and either a resume
(the JSONL records past the resumed step are dropped: those steps run again) or a refusal of a
folder that already holds a run, so a new run never appends to an old one's records.

    folder = RunFolder.open(out, resume=resume, resumable=True)
    if resume:
        step = restore(folder.last_checkpoint())  # the trainer's own state (None: from scratch)
        folder.truncate_after(step)

Knows nothing about what is trained or what a checkpoint holds (`training.checkpoint`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from leantrain.errors import LeantrainError
from leantrain.telemetry import JsonlSink
from leantrain.training.checkpoint import list_checkpoints


@dataclass(frozen=True)
class RunFolder:
    """The paths and sinks of one run's folder.

    Attributes:
        path: the folder itself (summary, plots and models go beside the sinks).
        metrics: one JSON line per step.
        completions: sampled completions, one JSON line each, with their step.
        checkpoints: where checkpoints go (`training.checkpoint`; created by the first one).
    """

    path: Path
    metrics: JsonlSink
    completions: JsonlSink
    checkpoints: Path

    @classmethod
    def open(cls, path: Path, *, resume: bool = False, resumable: bool = False) -> RunFolder:
        """Create `path` if needed and return its run folder.

        Args:
            path: the run folder (`--out`).
            resume: continue the run the folder holds (the caller restores its checkpoint and
                calls `truncate_after`); without it a folder that holds a run (metrics or a
                complete checkpoint) is refused with a LeantrainError.
            resumable: the kind of run can resume (`--resume`): the refusal says so.
        """
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        folder = cls(
            path=path,
            metrics=JsonlSink(path / "metrics.jsonl"),
            completions=JsonlSink(path / "completions.jsonl"),
            checkpoints=path / "checkpoints",
        )
        if not resume and (folder.metrics.path.exists() or folder.last_checkpoint()):
            hint = "pass --resume to continue it or " if resumable else ""
            raise LeantrainError(
                f"run folder {path} already holds a run; {hint}choose another --out"
            )
        return folder

    def last_checkpoint(self) -> Path | None:
        """The newest complete checkpoint, None if there is none."""
        checkpoints = list_checkpoints(self.checkpoints)
        return checkpoints[-1] if checkpoints else None

    def truncate_after(self, step: int) -> None:
        """Drop the records of steps after `step` from both sinks (on resume: the steps after
        the checkpoint were lost with the crash and will be run and logged again)."""
        self.metrics.truncate_after(step)
        self.completions.truncate_after(step)
