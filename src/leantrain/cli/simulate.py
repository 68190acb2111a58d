"""`leantrain simulate`: predict step time, generator idle fraction and speedup of sync, async
k=1,2 and async + speculative decoding in the tail, from a real run (calibrated) or for a
planned cluster of 64-1024 accelerators (rl/simulate.py); with `--learner`, the learner's step
(FSDP2 + Ulysses on GPUs of a preset, rl/learner_sim.py) alone or inside the plan."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from leantrain.cli.common import console, user_errors_exit_2
from leantrain.errors import LeantrainError

if TYPE_CHECKING:
    from leantrain.rl.learner_sim import LearnerPrediction, LearnerSetup


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
    learner: Annotated[
        bool,
        typer.Option(
            "--learner",
            help="Predict the learner's step (FSDP2 + Ulysses) from model, GPUs and links; "
            "with --plan, the plan's training and weight-sync times come from it.",
        ),
    ] = False,
    model: Annotated[
        str, typer.Option(help="Learner: model preset (qwen2.5-0.5b/1.5b/7b/32b, llama3-8b/70b).")
    ] = "qwen2.5-7b",
    params_b: Annotated[
        float | None, typer.Option(help="Learner: override the preset's parameters, billions.")
    ] = None,
    gpu: Annotated[str, typer.Option(help="Learner: GPU preset (a100, h100, h200).")] = "h100",
    gpus: Annotated[int, typer.Option(help="Learner: GPUs (FSDP ranks) without --plan.")] = 8,
    peak_tflops: Annotated[
        float | None, typer.Option(help="Learner: override the GPU's dense bf16 TFLOP/s.")
    ] = None,
    gpu_memory: Annotated[
        float | None, typer.Option(help="Learner: override the GPU's memory, GB.")
    ] = None,
    nvlink_gbps: Annotated[
        float | None, typer.Option(help="Learner: override NVLink GB/s per direction.")
    ] = None,
    ib_gbps: Annotated[
        float | None, typer.Option(help="Learner: override the network GB/s per GPU.")
    ] = None,
    gpus_per_node: Annotated[
        int | None, typer.Option(help="Learner: override GPUs per NVLink node (8).")
    ] = None,
    tokens: Annotated[
        float | None, typer.Option(help="Learner: tokens trained per step (without --plan).")
    ] = None,
    seq_len: Annotated[int, typer.Option(help="Learner: tokens of one sequence.")] = 4096,
    micro_tokens: Annotated[
        int | None,
        typer.Option(help="Learner: tokens per micro-batch of one SP group [max(16384, seq)]."),
    ] = None,
    sequence_parallel: Annotated[
        int, typer.Option(help="Learner: Ulysses size P (divides GPUs and heads).")
    ] = 1,
    mfu: Annotated[float, typer.Option(help="Learner: share of peak FLOP/s reached.")] = 0.4,
    recompute: Annotated[
        bool, typer.Option(help="Learner: activation checkpointing (one more forward).")
    ] = True,
    overlap: Annotated[
        float, typer.Option(help="Learner: share of FSDP traffic hidden behind compute.")
    ] = 1.0,
    rollout_s: Annotated[
        float | None,
        typer.Option(help="Learner: rollout seconds per step, to print the sync step's total."),
    ] = None,
) -> None:
    """Discrete-event model of sync vs async RL: calibrate on a run, or plan a cluster; and an
    analytic model of the learner's step (--learner)."""
    from leantrain.rl import learner_sim
    from leantrain.rl import simulate as sim

    setup = None
    if learner:
        if run is not None:
            raise LeantrainError("--learner goes alone or with --plan, not with --run")
        if rollout_s is not None and rollout_s < 0:
            raise LeantrainError(f"--rollout-s must be >= 0, got {rollout_s}")
        setup = learner_sim.LearnerSetup(
            model=learner_sim.model_shape(model, params_b=params_b),
            gpu=learner_sim.accelerator(
                gpu,
                peak_tflops=peak_tflops,
                memory_gb=gpu_memory,
                intra_gbps=nvlink_gbps,
                inter_gbps=ib_gbps,
                gpus_per_node=gpus_per_node,
            ),
            gpus=gpus,
            tokens=tokens if tokens is not None else 1.0,  # --plan sets its own
            seq_len=seq_len,
            micro_tokens=micro_tokens if micro_tokens is not None else max(16384, seq_len),
            sequence_parallel=sequence_parallel,
            mfu=mfu,
            recompute=recompute,
            overlap=overlap,
        )
        if plan is None:
            if tokens is None:
                raise LeantrainError("--learner without --plan needs --tokens (per step)")
            _print_learner(setup, learner_sim.predict_learner(setup), rollout_s)
            return
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
        learner=setup,
    )
    learned = f"; learner {model} on {gpu}, rl/learner_sim.py" if setup is not None else ""
    table = Table(
        title=f"plan: {sequences} responses/step, median {median}, p90 {p90}, cap {max_tokens}"
        + learned
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


def _print_learner(setup: LearnerSetup, p: LearnerPrediction, rollout_s: float | None) -> None:
    """The learner's step, part by part, and its memory per GPU."""
    m, g = setup.model, setup.gpu
    console.print(
        f"learner: {m.params / 1e9:.2f}B params, {m.layers} layers, hidden {m.hidden}, "
        f"{m.heads}/{m.kv_heads} heads on {setup.gpus} x {g.name} ({g.peak_flops / 1e12:.0f} "
        f"TFLOP/s bf16, {g.memory_gb:g} GB, NVLink {g.intra_gbps:g} GB/s, network "
        f"{g.inter_gbps:g} GB/s, {g.gpus_per_node} per node); {setup.tokens:,.0f} tokens/step, "
        f"sequences of {setup.seq_len}, SP {setup.sequence_parallel}, MFU {setup.mfu:.2f}, "
        f"recompute {'on' if setup.recompute else 'off'}, overlap {setup.overlap:.2f}"
    )
    table = Table(title="one optimizer step (rl/learner_sim.py)")
    for col in ("part", "seconds", "what"):
        table.add_column(col, justify="right")
    table.add_row("compute", f"{p.compute_s:.2f}", f"{p.flops:.3g} FLOPs")
    table.add_row(
        "FSDP traffic",
        f"{p.fsdp_s:.2f}",
        f"{p.fsdp_bytes / 1e9:.1f} GB per rank, {p.micro_batches} micro-batches",
    )
    table.add_row("  of it exposed", f"{p.exposed_fsdp_s:.2f}", f"overlap {setup.overlap:.2f}")
    table.add_row("Ulysses all-to-all", f"{p.sp_s:.2f}", f"{p.sp_bytes / 1e9:.1f} GB per rank")
    table.add_row("learner step", f"{p.train_s:.2f}", f"{setup.tokens / p.train_s:,.0f} tokens/s")
    table.add_row("weight sync", f"{p.sync_s:.2f}", "gather on rank 0, send to rollout")
    if rollout_s is not None:
        table.add_row("rollout (given)", f"{rollout_s:.2f}", "--rollout-s")
        table.add_row("sync RL step", f"{rollout_s + p.step_s:.2f}", "rollout + learner + sync")
    console.print(table)
    memory = Table(title=f"memory per GPU, GB (a {g.name} has {g.memory_gb:g})")
    for name in p.memory_gb:
        memory.add_column(name, justify="right")
    memory.add_row(*(f"{v:.1f}" for v in p.memory_gb.values()))
    console.print(memory)
