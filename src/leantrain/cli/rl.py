"""`leantrain rl` and `leantrain demo`: GRPO on a verifiable task, with a before/after table."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

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
    shortcut_overrides,
    user_errors_exit_2,
)
from leantrain.errors import LeantrainError
from leantrain.settings import load_settings

if TYPE_CHECKING:  # rl/config.py loads torch (through generation/): only once arguments parse
    from leantrain.rl.config import RLConfig

# `leantrain demo`: RLConfig's defaults plus these (configs/tiny-arith.yaml spells out the same
# run). The cosine decay steadies the final weights: with a constant lr the test accuracy
# swings by up to 8 points between checkpoints (docs/benchmarks.md, "GRPO demo"). Two threads on
# any machine, so the demo prints the README's figures there too (float sums split by another
# thread count give another run); the tiny model gains nothing from more.
DEMO_SETTINGS: dict[str, Any] = {"steps": 150, "grpo.lr_schedule": "cosine", "threads": 2}


def register(app: typer.Typer) -> None:
    app.command()(rl)
    app.command()(demo)


@user_errors_exit_2
def rl(
    config: ConfigOpt = None,
    override: OverrideOpt = None,
    model: ModelOpt = None,
    steps: StepsOpt = None,
    out: OutOpt = None,
    device: DeviceOpt = None,
    seed: SeedOpt = None,
    threads: ThreadsOpt = None,
    resume: Annotated[
        bool, typer.Option(help="Continue from the last checkpoint in --out.")
    ] = False,
    nproc_per_node: Annotated[
        int,
        typer.Option(
            "--nproc-per-node",
            min=1,
            help="Learner ranks on this machine: the same command re-launched under torchrun, "
            "data-parallel with FSDP2 (gloo on CPU, NCCL on GPUs); rank 0 generates and logs.",
        ),
    ] = 1,
) -> None:
    """GRPO post-training on a verifiable task; writes metrics, plots and checkpoints to --out."""
    from leantrain.distributed import launched_by_torchrun, run_torchrun
    from leantrain.rl.config import RLConfig

    options = {
        "model": model,
        "steps": steps,
        "out": out,
        "device": device,
        "seed": seed,
        "threads": threads,
    }
    cfg = command_settings(RLConfig, config, override, **options)
    if cfg.distributed.ray_learner_resource is not None:
        if nproc_per_node > 1:
            raise LeantrainError(
                "--nproc-per-node starts ranks on this machine; with "
                "distributed.ray_learner_resource set, Ray places distributed.ray_learner_ranks"
            )
        _train_on_ray_and_report(cfg, resume=resume)
        return
    if nproc_per_node > 1 and not launched_by_torchrun():
        argv = [] if config is None else ["--config", str(config)]
        argv += [a for name, v in options.items() if v is not None for a in (f"--{name}", str(v))]
        argv += [a for item in override or [] for a in ("--override", item)]
        argv += ["--resume"] if resume else []
        returncode = run_torchrun(nproc_per_node, ["-m", "leantrain", "rl", *argv])
        if returncode != 0:
            raise typer.Exit(code=returncode)
        return
    _train_and_report(cfg, resume=resume)


@user_errors_exit_2
def demo(
    steps: StepsOpt = None,
    out: OutOpt = None,
    device: DeviceOpt = None,
    threads: ThreadsOpt = None,
) -> None:
    """The tiny built-in model learning `arith` with GRPO: accuracy before and after, in minutes."""
    _train_and_report(demo_config(steps, out, device, threads), resume=False)


def demo_config(
    steps: int | None, out: Path | None, device: str | None, threads: int | None = None
) -> RLConfig:
    """The demo's run: RLConfig's defaults, then DEMO_SETTINGS, then the options given."""
    from leantrain.rl.config import RLConfig

    out = out or Path("runs") / f"demo-{time.strftime('%Y%m%d-%H%M%S')}"
    given = shortcut_overrides(steps=steps, out=out, device=device, threads=threads)
    return load_settings(RLConfig, None, **{**DEMO_SETTINGS, **given})


def _train_and_report(cfg: RLConfig, *, resume: bool) -> None:
    from leantrain.rl.grpo import GRPORun  # heavy imports only once arguments are valid
    from leantrain.training.threads import claim_threads

    quiet_libraries()
    claim_threads(cfg.threads)
    run = GRPORun(cfg, progress=True, resume=resume)
    if not run.world.is_main:  # only trains its share; rank 0 reports
        run.run()
        return
    _announce(cfg)
    _report(cfg, run.run())


def _train_on_ray_and_report(cfg: RLConfig, *, resume: bool) -> None:
    """The run with its learner ranks (and rollout workers) placed on a Ray cluster."""
    from leantrain.rl.ray_placement import run_learner_group

    quiet_libraries()
    d = cfg.distributed
    _announce(cfg)
    console.print(
        f"Ray: {d.ray_learner_ranks} learner rank(s) on nodes offering "
        f"[bold]{d.ray_learner_resource}[/] (cluster {cfg.orchestrator.ray_address or 'local'})"
    )
    placed = run_learner_group(cfg, resume)
    ranks = ", ".join(f"{p.rank}: {p.node_id[:8]} ({p.ip})" for p in placed)
    _report(cfg, placed[0].value, {"learner ranks on nodes": ranks})


def _announce(cfg: RLConfig) -> None:
    console.print(
        f"GRPO: model [bold]{cfg.model.name}[/], task [bold]{cfg.task.name}[/], "
        f"{cfg.steps} steps, out {cfg.out}"
    )


def _report(cfg: RLConfig, summary: dict[str, Any], rows: dict[str, str] | None = None) -> None:
    """The before/after table of a finished run from its summary, plus `rows`."""
    # A generated task's test problems are new ones; a jsonl task's come from its training rows.
    measured_on = "test" if summary["eval_unseen"] else "training-row"
    table = Table(
        title="leantrain rl",
        caption=f"{summary['eval_size']} "
        + ("new problems of the task" if summary["eval_unseen"] else "rows of the data file")
        + ", greedy",
        show_header=False,
    )
    before, after = summary["accuracy_before"], summary["accuracy_after"]
    table.add_row(f"{measured_on} accuracy before", f"{before:.1%}")
    table.add_row(
        f"{measured_on} accuracy after", f"{after:.1%}  ({(after - before) * 100:+.1f} points)"
    )
    total = max(summary["seconds_total"], 1e-9)
    for name in ("generating", "training", "idle"):
        secs = summary[f"seconds_{name}"]
        table.add_row(f"time {name}", f"{secs:.1f} s ({secs / total:.0%})")
    outputs = "metrics.jsonl, metrics.png, summary.json, checkpoints/"
    if (Path(cfg.out) / "events.jsonl").exists():  # rollout events, drawn by `leantrain view`
        outputs += ", events.jsonl"
    if (Path(cfg.out) / "report.html").exists():  # vision tasks: sampled images and episodes
        outputs += ", report.html"
    for name, value in (rows or {}).items():
        table.add_row(name, value)
    if "rollout_nodes" in summary:  # the Ray backend: where each worker ran
        nodes = summary["rollout_nodes"]
        where = ", ".join(f"{w}: {n[:8]}" for w, n in nodes.items())
        table.add_row("rollout workers on nodes", where or "none ready before the run ended")
    table.add_row("outputs", f"{cfg.out}/{outputs}")
    table.add_row("see the run", f"leantrain view {cfg.out}")
    console.print(table)
    for warning in summary.get("warnings", []):  # a run that could not learn says so last
        console.print(f"[bold red]warning:[/] {warning}")
