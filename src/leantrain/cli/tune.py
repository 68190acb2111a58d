"""`leantrain tune`: supervised fine-tuning (full, LoRA, LARS or LoRA+LARS), optionally
sequence-parallel over P processes with Ulysses attention.

`--sequence-parallel P` re-launches this same command under torchrun with P processes (gloo on
CPU, NCCL on GPUs); each process joins the group, switches the model's attention to Ulysses and
trains on its 1/P of every sequence; rank 0 evaluates and writes the run folder. The loop lives in
`leantrain.memory.sft` and the sequence-parallel step in `leantrain.distributed`; this module is the
only place that knows both (they sit on the same layer and may not import each other).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from leantrain.cli.common import (
    ConfigOpt,
    DeviceOpt,
    ModelOpt,
    OutOpt,
    OverrideOpt,
    SeedOpt,
    StepsOpt,
    ThreadsOpt,
    command_settings,
    console,
    quiet_libraries,
    user_errors_exit_2,
)
from leantrain.errors import LeantrainError
from leantrain.training.threads import claim_threads

if TYPE_CHECKING:  # heavy imports wait until the arguments are valid
    from leantrain.memory.config import TuneConfig

DataOpt = Annotated[
    Path | None,
    typer.Option("--data", help="JSONL of {prompt, completion} rows instead of the built-in task."),
]
MethodOpt = Annotated[str | None, typer.Option("--method", help="full, lora, lars or lora+lars.")]
ParallelOpt = Annotated[
    int,
    typer.Option(
        "--sequence-parallel",
        min=1,
        help="Split every sequence over P processes (Ulysses; launched through torchrun).",
    ),
]


def register(app: typer.Typer) -> None:
    app.command()(tune)


@user_errors_exit_2
def tune(
    config: ConfigOpt = None,
    override: OverrideOpt = None,
    data: DataOpt = None,
    method: MethodOpt = None,
    model: ModelOpt = None,
    steps: StepsOpt = None,
    out: OutOpt = None,
    device: DeviceOpt = None,
    seed: SeedOpt = None,
    sequence_parallel: ParallelOpt = 1,
    threads: ThreadsOpt = None,
) -> None:
    """Supervised fine-tuning; writes metrics, a plot, completions and a summary to --out."""
    claim_threads(threads)
    from leantrain.memory.config import TuneConfig

    options = {
        "data": data,
        "method": method,
        "model": model,
        "steps": steps,
        "out": out,
        "device": device,
        "seed": seed,
    }
    cfg = command_settings(TuneConfig, config, override, **options)
    if cfg.data is not None and not Path(cfg.data).is_file():
        raise LeantrainError(f"data: file not found: {cfg.data}")
    if sequence_parallel > 1 and "WORLD_SIZE" not in os.environ:
        _launch(sequence_parallel, config, override or [], options)
        return
    _train_and_report(cfg, sequence_parallel)


def _launch(
    processes: int, config: Path | None, override: list[str], options: dict[str, object]
) -> None:
    """Run this command again, with the same options, under torchrun with `processes` ranks,
    and wait for it."""
    argv = [] if config is None else ["--config", str(config)]
    for name, value in options.items():
        if value is not None:
            argv += [f"--{name}", str(value)]
    for item in override:
        argv += ["--override", item]
    from leantrain.distributed.launch import run_torchrun, torchrun_command

    # This module as a script: its `__main__` block runs `tune` alone.
    target = [__file__, *argv, "--sequence-parallel", str(processes)]
    shown = " ".join(torchrun_command(processes, target)[2:])
    console.print(f"launching {processes} processes: {shown}")
    returncode = run_torchrun(processes, target)
    if returncode != 0:
        raise typer.Exit(code=returncode)


def _train_and_report(cfg: TuneConfig, sequence_parallel: int) -> None:
    from leantrain.memory.sft import SFTRun

    quiet_libraries()
    hooks = None
    if sequence_parallel > 1:
        from leantrain.distributed import SequenceParallelHooks, join
        from leantrain.models import pick_device

        world = join(pick_device(cfg.device), timeout_s=600.0)
        if world.size != sequence_parallel:
            raise LeantrainError(
                f"--sequence-parallel {sequence_parallel} but {world.size} processes"
            )
        hooks = SequenceParallelHooks()
    run = SFTRun(cfg, hooks=hooks)
    if run.hooks.is_main:
        console.print(
            f"tune: model [bold]{cfg.model.name}[/], method [bold]{cfg.method}[/], "
            f"data {cfg.data or cfg.task}, {cfg.steps} steps, "
            f"{sequence_parallel} process(es), out {cfg.out}"
        )
    summary = run.run()
    if not run.hooks.is_main:
        return
    table = Table(
        title="leantrain tune",
        caption=f"test: {summary['eval_size']} examples never trained on, greedy",
        show_header=False,
    )
    before, after = summary["accuracy_before"], summary["accuracy_after"]
    table.add_row("test accuracy before", f"{before:.1%}")
    table.add_row("test accuracy after", f"{after:.1%}  ({(after - before) * 100:+.1f} points)")
    table.add_row("trainable parameters", f"{summary['trainable_parameters']:,}")
    table.add_row("training time", f"{summary['seconds_training']:.1f} s")
    table.add_row(
        "outputs", f"{cfg.out}/metrics.jsonl, metrics.png, completions.jsonl, summary.json"
    )
    console.print(table)


if __name__ == "__main__":  # the torchrun entry of `--sequence-parallel` (run as a script)
    _app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    _app.command()(tune)
    _app()
