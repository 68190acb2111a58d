"""The one supervised fine-tuning loop: AdamW over the trainable parameters, gradient-norm
clipping, a learning rate that is a constant or a function of the step, a progress bar, an
optional early stop, and optional checkpoints to resume from.

What varies between trainers comes in as arguments: the step's `backward` (it draws the data,
runs the forward and calls `backward()` itself, so it can split a batch into chunks), the rate,
the weight decay, the clip, the number of steps. Used by the preset builds (models/presets/),
`leantrain tune` (memory/sft.py), safety's fine-tuning and unlearning, and the drafter's spot
trainer and warm start.

    loop = SFTLoop(model, lr=3e-3, weight_decay=0.01)
    history = loop.run(lambda: backward_token_mean(model, next_chunks()), 200, label="sft")

One step is, in this order and nothing else: set the rate, `backward()`, `clip_grad_norm_`,
`AdamW.step`, `zero_grad(set_to_none=True)`. The loop draws no random numbers. Preset builds are
cached under a hash of their recipe, not of this code: a change to that order or to the RNG's
use gives every preset other weights than the cached ones.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn
from torch import nn
from torch.distributed.tensor import DTensor

from leantrain.training.checkpoint import list_checkpoints, load_checkpoint, save_checkpoint
from leantrain.training.threads import follow_share

# A step's forward and backward: returns the loss, or the loss and more numbers to log.
Backward = Callable[[], float | tuple[float, Mapping[str, float]]]


@dataclass(frozen=True)
class StepStats:
    """What one optimizer step did.

    Attributes:
        step: steps taken, this one included.
        loss: what `backward` returned.
        grad_norm: the gradients' total norm before clipping.
        lr: the learning rate of this step.
        seconds: wall time of the step, `backward` included.
        extra: the other numbers `backward` returned.
    """

    step: int
    loss: float
    grad_norm: float
    lr: float
    seconds: float
    extra: Mapping[str, float] = field(default_factory=dict)

    def record(self) -> dict[str, float]:
        """One metrics line: step, loss, grad_norm, lr, the extras, step_s."""
        return {
            "step": self.step,
            "loss": self.loss,
            "grad_norm": self.grad_norm,
            "lr": self.lr,
            **self.extra,
            "step_s": round(self.seconds, 4),
        }


@dataclass(frozen=True)
class Checkpoints:
    """Where and how often `SFTLoop.run` checkpoints (`training.checkpoint`: weights, optimizer,
    RNG state, step), and how many it keeps. The model must be a Hugging Face one
    (`save_pretrained`)."""

    root: Path
    every: int
    keep: int = 2


class SFTLoop:
    """AdamW over `model`'s trainable parameters with gradient-norm clipping.

    Args:
        model: what trains; `run` puts it in train mode and leaves it in eval mode.
        lr: the learning rate, or the function of the step index (0 for the first step) that
            gives each step's rate.
        params: the parameters to train (default: those of `model` that require grad).
        weight_decay: AdamW's decoupled weight decay.
        max_grad_norm: the gradients' total norm is clipped to this before each step.
    """

    def __init__(
        self,
        model: nn.Module,
        lr: float | Callable[[int], float],
        *,
        params: Sequence[nn.Parameter] | None = None,
        weight_decay: float = 0.0,
        max_grad_norm: float = 1.0,
    ) -> None:
        self.model = model
        self.lr = lr
        self.params = (
            [p for p in model.parameters() if p.requires_grad] if params is None else list(params)
        )
        self.max_grad_norm = max_grad_norm
        self.optimizer = torch.optim.AdamW(self.params, lr=self.rate(0), weight_decay=weight_decay)
        self.steps = 0

    def rate(self, step: int) -> float:
        """The learning rate of step `step` (0-based)."""
        return self.lr(step) if callable(self.lr) else self.lr

    def step(self, backward: Backward) -> StepStats:
        """One optimizer step on the gradients `backward` leaves."""
        start = time.perf_counter()
        lr = self.rate(self.steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        out = backward()
        loss, extra = out if isinstance(out, tuple) else (out, {})
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm)
        if isinstance(grad_norm, DTensor):  # FSDP-sharded: the norm over every rank's shard
            grad_norm = grad_norm.full_tensor()
        grad_norm = float(grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        return StepStats(self.steps, float(loss), grad_norm, lr, time.perf_counter() - start, extra)

    def run(
        self,
        backward: Backward,
        steps: int,
        *,
        label: str,
        progress: bool = True,
        transient: bool = True,
        stop: Callable[[StepStats], bool] | None = None,
        on_step: Callable[[StepStats], None] | None = None,
        checkpoints: Checkpoints | None = None,
    ) -> list[StepStats]:
        """Step until `steps` steps are taken in all (from `self.steps`, so a resumed loop goes
        on where it stopped), or until `stop(stats)` says so after a step.

        Args:
            backward: one step's forward and backward (see `Backward`).
            steps: the total number of steps.
            label: the progress bar's text (followed by the last loss).
            progress: show the bar; `transient`: clear it when done (a one-off build), or leave
                it on screen (a run the user started).
            stop: checked after every step (and its checkpoint).
            on_step: called with every step's stats (a metrics sink).
            checkpoints: save every `checkpoints.every` steps and after the last one.

        Returns:
            The stats of the steps this call took.
        """
        history = []
        self.model.train()
        with Progress(
            *Progress.get_default_columns()[:1],
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            disable=not progress,
            transient=transient,
        ) as bar:
            job = bar.add_task(label, total=steps, completed=self.steps)
            while self.steps < steps:
                follow_share()
                stats = self.step(backward)
                history.append(stats)
                if on_step is not None:
                    on_step(stats)
                bar.update(job, advance=1, description=f"{label}, loss {stats.loss:.3f}")
                if checkpoints is not None and (
                    self.steps % checkpoints.every == 0 or self.steps == steps
                ):
                    self.save(checkpoints)
                if stop is not None and stop(stats):
                    break
        self.model.eval()
        return history

    def save(self, checkpoints: Checkpoints) -> Path:
        """Checkpoint the weights, optimizer, RNG state and step under `checkpoints.root`,
        keeping the newest `checkpoints.keep`; returns the checkpoint's folder."""
        root, keep = checkpoints.root, checkpoints.keep
        return save_checkpoint(root, self.steps, self.model, self.optimizer.state_dict(), {}, keep)

    def resume(self, root: Path) -> Path | None:
        """Restore the newest complete checkpoint under `root` (weights, optimizer, RNG state,
        step) and return its folder; None, restoring nothing, when there is none."""
        found = list_checkpoints(root)
        if not found:
            return None
        self.steps = load_checkpoint(found[-1], self.model, self.optimizer)["step"]
        return found[-1]
