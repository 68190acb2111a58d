"""`leantrain zo`: zeroth-order fine-tuning (MeZO family) run as an inference workload."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

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


def register(app: typer.Typer) -> None:
    app.command()(zo)


@user_errors_exit_2
def zo(
    config: ConfigOpt = None,
    override: OverrideOpt = None,
    model: ModelOpt = None,
    steps: StepsOpt = None,
    out: OutOpt = None,
    device: DeviceOpt = None,
    seed: SeedOpt = None,
    data: Annotated[
        Path | None,
        typer.Option(
            "--data",
            help="Your JSONL: {prompt, completion} or {text} per line; replaces the config's task.",
        ),
    ] = None,
    backend: Annotated[
        str | None,
        typer.Option(
            "--backend",
            help="Where the perturbed states are scored (zo.backend): native (our engine) or "
            "vllm (an in-process vLLM engine; `make vllm`). Seeds and updates stay ours.",
        ),
    ] = None,
    threads: ThreadsOpt = None,
) -> None:
    """Fine-tune with forward passes only (MeZO/SPSA); writes metrics, plot, summary and the
    model (an HF folder) to --out."""
    claim_threads(threads)
    from leantrain.zo.config import ZOConfig

    if backend is not None:  # before the -o overrides, which have the last word
        override = [f"zo.backend={backend}", *(override or [])]
    cfg = command_settings(
        ZOConfig,
        config,
        override,
        model=model,
        steps=steps,
        out=out,
        device=device,
        seed=seed,
        data=data,
    )
    if cfg.data is not None and not cfg.data.is_file():
        raise LeantrainError(f"data file not found: {cfg.data}")
    from leantrain.zo.run import ZORun  # heavy imports only once arguments are valid

    quiet_libraries()
    run = ZORun(cfg)
    console.print(
        f"ZO ({cfg.zo.estimator}, {cfg.zo.target}, engine {cfg.zo.engine}"
        f"{', scored on vllm' if cfg.zo.backend == 'vllm' else ''}): model "
        f"[bold]{cfg.model.name}[/], data [bold]{cfg.data or cfg.task.name}[/], "
        f"{cfg.steps} steps, out {cfg.out}"
    )
    summary = run.run()
    table = Table(title="leantrain zo", show_header=False)
    # Under 10 rows of data none is spared for a test set: the loss is the training rows'.
    measured_on = "training" if summary["eval_on_training_rows"] else "test"
    for key, fmt in (("accuracy", "{:.1%}"), ("loss", "{:.4f}")):
        if f"{key}_before" in summary:
            before, after = summary[f"{key}_before"], summary[f"{key}_after"]
            table.add_row(f"{measured_on} {key} before", fmt.format(before))
            table.add_row(f"{measured_on} {key} after", fmt.format(after))
    table.add_row("trainable parameters", f"{summary['trainable_parameters']:,}")
    table.add_row("steps per second", f"{summary['steps_per_s']}")
    table.add_row("outputs", f"{cfg.out}/metrics.jsonl, metrics.png, summary.json")
    if summary["saved"]:
        table.add_row("model (HF folder)", summary["saved"])
    console.print(table)
