"""`leantrain tune`: supervised fine-tuning (full, LoRA, LARS or LoRA+LARS), optionally
data-parallel over N processes (FSDP2) or sequence-parallel over P (Ulysses attention).

`--nproc-per-node N` or `--sequence-parallel P` re-launches this same command under torchrun with
that many processes (gloo on CPU, NCCL on GPUs); plain `torchrun -m leantrain tune ...` runs
data-parallel over torchrun's ranks. Data parallel: each rank shards the model (FSDP2, per decoder
layer) and trains on its token-balanced share of every batch, with the loss divided by the whole
batch's token count, so N ranks take the single-process step. Sequence parallel: each rank
switches the model's attention to Ulysses and trains on its 1/P of every sequence. Either way rank
0 evaluates and writes the run folder. The loop lives in `leantrain.memory.sft` and the
multi-process steps in `leantrain.distributed`; this module chooses between them.
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
    int,
    typer.Option(
        "--sequence-parallel",
        min=1,
        help="Split every sequence over P processes (Ulysses; launched through torchrun).",
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
    sequence_parallel: ParallelOpt = 1,
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
    cfg = command_settings(TuneConfig, config, override, **options)
    if cfg.data is not None and not Path(cfg.data).is_file():
        raise LeantrainError(f"data: file not found: {cfg.data}")
    if sequence_parallel > 1 and nproc_per_node > 1:
        raise LeantrainError(
            f"--sequence-parallel {sequence_parallel} with --nproc-per-node {nproc_per_node}: "
            "data parallelism over sequence-parallel groups is not built; pass one of them"
        )
    if nproc_per_node > 1:
        check_data_parallel(cfg, nproc_per_node, "--nproc-per-node")
    if "WORLD_SIZE" not in os.environ:
        if sequence_parallel > 1:
            _launch(sequence_parallel, "--sequence-parallel", config, override or [], options)
            return
        if nproc_per_node > 1:
            _launch(nproc_per_node, "--nproc-per-node", config, override or [], options)
            return
    _train_and_report(cfg, sequence_parallel, nproc_per_node)


def check_data_parallel(cfg: TuneConfig, ranks: int, source: str) -> None:
    """A LeantrainError naming the setting when `ranks` data-parallel ranks cannot run `cfg`:
    they must divide `batch_size` (each rank trains on an equal share of every batch's rows)."""
    if cfg.batch_size % ranks:
        raise LeantrainError(
            f"batch_size {cfg.batch_size} is not a multiple of the {ranks} data-parallel ranks "
            f"({source}): every rank trains on an equal share of each batch's rows; use a "
            "batch_size or a rank count that fits"
        )


def _launch(
    processes: int,
    flag: str,
    config: Path | None,
    override: list[str],
    options: dict[str, object],
) -> None:
    """Run this command again, with the same options, under torchrun with `processes` ranks
    (`flag` passes their number on), and wait for it."""
    argv = [] if config is None else ["--config", str(config)]
    for name, value in options.items():
        if value is not None:
            argv += [f"--{name}", str(value)]
    for item in override:
        argv += ["--override", item]
    from leantrain.distributed.launch import run_torchrun, torchrun_command

    # This module as a script: its `__main__` block runs `tune` alone.
    target = [__file__, *argv, flag, str(processes)]
    shown = " ".join(torchrun_command(processes, target)[2:])
    console.print(f"launching {processes} processes: {shown}")
    returncode = run_torchrun(processes, target)
    if returncode != 0:
        raise typer.Exit(code=returncode)


def step_hooks(
    cfg: TuneConfig, sequence_parallel: int = 1, nproc_per_node: int = 1
) -> StepHooks | None:
    """The `SFTRun` hooks of this process: None in a single process; under torchrun (this
    command re-launched, or plain `torchrun -m leantrain tune`) it joins the process group and
    returns sequence-parallel hooks when `sequence_parallel` > 1, data-parallel ones otherwise.
    Settings the ranks cannot run are refused before joining, naming the setting."""
    ranks = os.environ.get("WORLD_SIZE")
    if ranks is None:
        return None
    try:
        ranks = int(ranks)
    except ValueError:
        raise LeantrainError(f"WORLD_SIZE={ranks!r} is not an integer") from None
    if ranks == 1 and sequence_parallel == nproc_per_node == 1:
        return None  # torchrun with one process: a plain single-process run
    from leantrain.distributed import DataParallelHooks, SequenceParallelHooks, join
    from leantrain.models import pick_device

    if sequence_parallel > 1:
        if ranks != sequence_parallel:
            raise LeantrainError(f"--sequence-parallel {sequence_parallel} but {ranks} processes")
        join(pick_device(cfg.device), cfg.distributed.timeout_s)
        return SequenceParallelHooks()
    if nproc_per_node > 1 and ranks != nproc_per_node:
        raise LeantrainError(
            f"--nproc-per-node {nproc_per_node} but torchrun started {ranks} processes "
            "(WORLD_SIZE); pass the same number to both, or leave --nproc-per-node out"
        )
    check_data_parallel(cfg, ranks, "WORLD_SIZE")
    world = join(pick_device(cfg.device), cfg.distributed.timeout_s)
    return DataParallelHooks(world)


def _train_and_report(cfg: TuneConfig, sequence_parallel: int, nproc_per_node: int) -> None:
    from leantrain.distributed import leave
    from leantrain.memory.sft import SFTRun

    quiet_libraries()
    hooks = step_hooks(cfg, sequence_parallel, nproc_per_node)
    try:
        run = SFTRun(cfg, hooks=hooks)
        if run.hooks.is_main:
            ranks = "1 process(es)"
            if hooks is not None:
                mode = "sequence" if sequence_parallel > 1 else "data"
                ranks = f"{os.environ['WORLD_SIZE']} processes ({mode} parallel)"
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


if __name__ == "__main__":  # the torchrun entry of `--sequence-parallel` (run as a script)
    _app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    _app.command()(tune)
    _app()
