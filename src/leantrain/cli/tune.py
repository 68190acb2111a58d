"""`leantrain tune`: supervised fine-tuning (full, LoRA, LARS or LoRA+LARS), optionally
data-parallel over N processes (FSDP2), sequence-parallel over P (Ulysses attention), or both.

`--nproc-per-node N` (or `--sequence-parallel P` alone: P processes) re-launches this same command
under torchrun with that many processes (gloo on CPU, NCCL on GPUs); plain `torchrun -m leantrain
tune ...` runs over torchrun's ranks. `--sequence-parallel P` sets
`distributed.sequence_parallel_size`. Data parallel: each rank shards the model (FSDP2, per
decoder layer) and trains on its token-balanced share of every batch, with the loss divided by
the whole batch's token count, so N ranks take the single-process step. Sequence parallel: each
rank switches the model's attention to Ulysses and trains on its 1/P of every sequence. Both (N
ranks, P < N): N/P data-parallel groups of P ranks, each group a share of the batch, each rank
1/P of its group's sequences, FSDP2 over all N. Rank 0 evaluates and writes the run folder. The
loop lives in `leantrain.memory.sft` and the multi-process steps in `leantrain.distributed`; this
module chooses between them.
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
    from leantrain.memory.sft import StepHooks

DataOpt = Annotated[
    Path | None,
    typer.Option("--data", help="JSONL of {prompt, completion} rows instead of the built-in task."),
]
MethodOpt = Annotated[str | None, typer.Option("--method", help="full, lora, lars or lora+lars.")]
ParallelOpt = Annotated[
    int | None,
    typer.Option(
        "--sequence-parallel",
        min=1,
        help="Split every sequence over P processes (Ulysses; sets "
        "distributed.sequence_parallel_size). Alone: P processes through torchrun; with "
        "--nproc-per-node N: N/P data-parallel groups of P (P must divide N and the model's "
        "attention heads).",
    ),
]
NprocOpt = Annotated[
    int,
    typer.Option(
        "--nproc-per-node",
        min=1,
        help="Data-parallel ranks on this machine: the same command re-launched under torchrun, "
        "FSDP2-sharded, each rank training on its share of every batch (batch_size must be a "
        "multiple of N); rank 0 evaluates and writes.",
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
    sequence_parallel: ParallelOpt = None,
    nproc_per_node: NprocOpt = 1,
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
    # The flag is the setting's shortcut; the last word, after any -o.
    flag = [] if sequence_parallel is None else [f"{SETTING}={sequence_parallel}"]
    cfg = command_settings(TuneConfig, config, [*(override or []), *flag], **options)
    setting = SETTING if sequence_parallel is None else "--sequence-parallel"
    if cfg.data is not None and not Path(cfg.data).is_file():
        raise LeantrainError(f"data: file not found: {cfg.data}")
    size = cfg.distributed.sequence_parallel_size
    processes = nproc_per_node if nproc_per_node > 1 else size
    if processes > 1:
        check_parallel(cfg, processes, "--nproc-per-node", setting)
    if "WORLD_SIZE" not in os.environ and processes > 1:
        flags = ["--nproc-per-node", str(processes)]
        if sequence_parallel is not None:
            flags += ["--sequence-parallel", str(sequence_parallel)]
        _launch(processes, flags, config, override or [], options)
        return
    _train_and_report(cfg, nproc_per_node, setting)


SETTING = "distributed.sequence_parallel_size"


def check_parallel(cfg: TuneConfig, ranks: int, source: str, setting: str = SETTING) -> None:
    """A LeantrainError naming the setting when `ranks` ranks cannot run `cfg`: the
    sequence-parallel size (named `setting`) must divide them, and the data-parallel groups
    they form must divide `batch_size` (each group trains on an equal share of every batch's
    rows; without sequence parallelism a group is one rank)."""
    from leantrain.distributed.sequence import check_ranks

    size = cfg.distributed.sequence_parallel_size
    check_ranks(ranks, size, setting)
    groups = ranks // size
    if cfg.batch_size % groups:
        what = f"{groups} data-parallel ranks ({source})"
        if size > 1:
            what = f"{groups} data-parallel groups ({ranks} ranks ({source}) / {setting} {size})"
        raise LeantrainError(
            f"batch_size {cfg.batch_size} is not a multiple of the {what}: every group trains "
            "on an equal share of each batch's rows; use a batch_size or a rank count that fits"
        )


def _launch(
    processes: int,
    flags: list[str],
    config: Path | None,
    override: list[str],
    options: dict[str, object],
) -> None:
    """Run this command again, with the same options, under torchrun with `processes` ranks
    (`flags` pass their number and the sequence-parallel flag on), and wait for it."""
    argv = [] if config is None else ["--config", str(config)]
    for name, value in options.items():
        if value is not None:
            argv += [f"--{name}", str(value)]
    for item in override:
        argv += ["--override", item]
    from leantrain.distributed.launch import run_torchrun, torchrun_command

    # This module as a script: its `__main__` block runs `tune` alone.
    target = [__file__, *argv, *flags]
    shown = " ".join(torchrun_command(processes, target)[2:])
    console.print(f"launching {processes} processes: {shown}")
    returncode = run_torchrun(processes, target)
    if returncode != 0:
        raise typer.Exit(code=returncode)


def step_hooks(
    cfg: TuneConfig, nproc_per_node: int = 1, setting: str = SETTING
) -> StepHooks | None:
    """The `SFTRun` hooks of this process: None in a single process; under torchrun (this
    command re-launched, or plain `torchrun -m leantrain tune`) it joins the process group and
    returns sequence-parallel hooks when `cfg.distributed.sequence_parallel_size` is the number
    of ranks, data-parallel ones otherwise (over sequence-parallel groups when that size is
    above 1). Settings the ranks cannot run are refused before joining, naming the setting (the
    sequence-parallel size as `setting`)."""
    ranks = os.environ.get("WORLD_SIZE")
    if ranks is None:
        return None
    try:
        ranks = int(ranks)
    except ValueError:
        raise LeantrainError(f"WORLD_SIZE={ranks!r} is not an integer") from None
    size = cfg.distributed.sequence_parallel_size
    if ranks == 1 and size == nproc_per_node == 1:
        return None  # torchrun with one process: a plain single-process run
    from leantrain.distributed import DataParallelHooks, SequenceParallelHooks, join
    from leantrain.models import pick_device

    if nproc_per_node > 1 and ranks != nproc_per_node:
        raise LeantrainError(
            f"--nproc-per-node {nproc_per_node} but torchrun started {ranks} processes "
            "(WORLD_SIZE); pass the same number to both, or leave --nproc-per-node out"
        )
    check_parallel(cfg, ranks, "WORLD_SIZE", setting)
    world = join(pick_device(cfg.device), cfg.distributed.timeout_s)
    if size == ranks:  # one group: every rank keeps the whole model, no FSDP
        return SequenceParallelHooks(setting=setting)
    return DataParallelHooks(world, size, setting)


def _train_and_report(cfg: TuneConfig, nproc_per_node: int, setting: str) -> None:
    from leantrain.distributed import leave
    from leantrain.memory.sft import SFTRun

    quiet_libraries()
    hooks = step_hooks(cfg, nproc_per_node, setting)
    try:
        run = SFTRun(cfg, hooks=hooks)
        if run.hooks.is_main:
            ranks = "1 process(es)"
            if hooks is not None:
                n, size = int(os.environ["WORLD_SIZE"]), cfg.distributed.sequence_parallel_size
                mode = {1: "data parallel", n: "sequence parallel"}.get(
                    size, f"{n // size} data-parallel x {size} sequence-parallel"
                )
                ranks = f"{n} processes ({mode})"
            console.print(
                f"tune: model [bold]{cfg.model.name}[/], method [bold]{cfg.method}[/], "
                f"data {cfg.data or cfg.task}, {cfg.steps} steps, {ranks}, out {cfg.out}"
            )
        summary = run.run()
    finally:
        leave()
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


if __name__ == "__main__":  # the torchrun entry of `_launch` (run as a script)
    _app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    _app.command()(tune)
    _app()
