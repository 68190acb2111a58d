"""`leantrain simulate`: predict step time, generator idle fraction and speedup of sync, async
k=1,2 and async + speculative decoding in the tail, from a real run (calibrated) or for a
planned cluster of 64-1024 accelerators (rl/simulate.py)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from leantrain.cli.common import console, user_errors_exit_2
from leantrain.errors import LeantrainError


def register(app: typer.Typer) -> None:
    app.command()(simulate)


@user_errors_exit_2
def simulate(
    run: Annotated[
        Path | None,
        typer.Option("--run", help="Run folder to calibrate on (its metrics.jsonl)."),
    ] = None,
    plan: Annotated[
        str | None,
        typer.Option("--plan", help="Accelerator counts to plan for, e.g. 64,128,256,512,1024."),
    ] = None,
    workers: Annotated[int, typer.Option(help="Rollout workers (--run).")] = 1,
    slots: Annotated[int, typer.Option(help="Sequences a worker decodes at once.")] = 128,
    spec_threshold: Annotated[
        int, typer.Option(help="Speculative decoding at <= this many live sequences.")
    ] = 32,
    spec_tokens: Annotated[
        float, typer.Option(help="Tokens a speculative iteration yields (accepted + 1).")
    ] = 2.0,
    spec_cost: Annotated[
        float, typer.Option(help="Cost of a speculative iteration / a plain one.")
    ] = 1.3,
    median: Annotated[int, typer.Option(help="Plan: median response tokens.")] = 1500,
    p90: Annotated[int, typer.Option(help="Plan: 90th-percentile response tokens.")] = 6000,
    max_tokens: Annotated[int, typer.Option(help="Plan: generation budget.")] = 16384,
    sequences: Annotated[int, typer.Option(help="Plan: responses per step.")] = 8192,
    plot: Annotated[Path | None, typer.Option(help="Plan: write a PNG plot here.")] = None,
) -> None:
    """Discrete-event model of sync vs async RL: calibrate on a run, or plan a cluster."""
    from leantrain.rl import simulate as sim

    if (run is None) == (plan is None):
        raise LeantrainError("give exactly one of --run DIR (calibrate) or --plan N,N,...")
    if run is not None:
        cal = sim.calibrate(run, slots=slots)
        cluster = replace(cal.cluster, rollout_workers=workers)
        spec = replace(
            cluster, spec_threshold=spec_threshold, spec_tokens=spec_tokens, spec_cost=spec_cost
        )
        console.print(
            f"calibrated on {run}: {cal.workload.steps} steps x {cal.workload.sequences} "
            f"responses; decode iteration {cluster.iteration_s * 1e3:.2f} ms + "
            f"{cluster.sequence_s * 1e6:.1f} us per live sequence (fit error "
            f"{cal.fit_error:.0%}), train {cluster.train_s:.2f} s/step, weight sync "
            f"{cluster.sync_s * 1e3:.1f} ms/step"
        )
        table = Table(title="predicted (batch-granular rollouts, as the local and Ray backends)")
        for col in ("setup", "s/step", "total s", "generator idle", "speedup"):
            table.add_column(col, justify="right")
        sync = None
        for name, c, k in (
            ("sync", cluster, 0),
            ("async k=1", cluster, 1),
            ("async k=2", cluster, 2),
            ("async k=1 + SD", spec, 1),
        ):
            p = sim.simulate(c, cal.workload, k)
            sync = sync or p.seconds
            table.add_row(
                name,
                f"{p.step_s:.2f}",
                f"{p.seconds:.1f}",
                f"{p.generation_idle:.0%}",
                f"{sync / p.seconds:.2f}x",
            )
        console.print(table)
        return
    try:
        counts = [int(x) for x in plan.split(",")]
    except ValueError:
        raise LeantrainError(f"--plan takes comma-separated integers, got {plan!r}") from None
    if not counts or min(counts) < 2:
        raise LeantrainError("--plan needs accelerator counts >= 2 (rollout and trainer)")
    lengths = sim.lognormal_lengths(median, p90, max_tokens)
    rows = sim.plan(
        counts,
        sequences=sequences,
        lengths=lengths,
        spec=(spec_threshold, spec_tokens, spec_cost),
    )
    table = Table(
        title=f"plan: {sequences} responses/step, median {median}, p90 {p90}, cap {max_tokens}"
    )
    for col in ("accelerators", "setup", "s/step", "generator idle", "speedup"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            str(r.accelerators),
            r.setup,
            f"{r.step_s:.0f}",
            f"{r.generation_idle:.0%}",
            f"{r.speedup:.2f}x",
        )
    console.print(table)
    if plot is not None:
        sim.plot_plan(rows, plot)
        console.print(f"wrote {plot}")
