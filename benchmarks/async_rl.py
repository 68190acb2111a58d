"""Asynchronous GRPO against synchronous GRPO: the same run (tiny model, `arith` with its Pareto
long tail, the same number of optimizer steps) trained sync, async k=1 and async k=2, one after
another in this process.

- sync: generate a step's batch, then train on it, in turn; one process, `--sync-threads` torch
  threads (1 by default: the ~1 M-parameter model gains nothing from a second thread, and on a
  busy machine OpenMP spin-waits make 2 threads slower).
- async k: a rollout worker generates step n+1.. while the trainer trains step n, one torch
  thread each, so both cores work; each batch is generated on one policy version, at most k
  versions behind the trainer, with decoupled-PPO correction. The worker is a spawned process by
  default (`--backend process`: the tiny model's decode loop is Python-bound, and a worker THREAD
  shares the trainer's GIL); `--backend ray` makes it a Ray actor, `--backend local` a thread.
  The worker's start-up (a few seconds: a fresh process imports torch) is inside the timed run;
  the trainer generates its batches itself until the worker is ready.

Reported per mode: wall time of the training loop (held-out evaluations excluded), generation
idle fraction (share of the run the generator was not generating), final held-out accuracy
(greedy), max observed staleness; and the speedups sync time / async time (median over repeats).

    python benchmarks/async_rl.py            # full: 20 steps, 200 held-out problems, 3 repeats
    python benchmarks/async_rl.py --quick    # under 120 s on 2 idle CPU cores
    python benchmarks/async_rl.py --config configs/smollm2-arith.yaml --repeats 1 \
        --modes sync,k1 --out benchmarks/results/async_smollm2.json
                                 # issue 27: SmolLM2, `arith` in chat style; about 30 min

`--config FILE` takes the run's base settings (model, task and its options, sampling, GRPO
hyperparameters) from an RLConfig YAML; this script's own settings still apply on top: steps,
held-out size, seed (the repeat), mode, staleness, backend, one rollout thread, torch threads
(`threads` is cleared: this script sets them), checkpoints only at the end, CPU, and the run
folder. `--model` replaces the config's model when given. Without `--config` the run is the tiny
model on `arith` (worked style) with the RLConfig defaults, as before.

Writes benchmarks/results/async_rl.json or `--out` (keys `speedup_k1`, `speedup_k2`,
`accuracy_sync`, `accuracy_k1`, `max_observed_staleness_k1`, `model`, and details). `--modes
sync,k1` skips k2 (its keys are then null): issue 27 asks only for k=1 against sync.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from leantrain.rl.config import RLConfig
from leantrain.rl.grpo import GRPORun
from leantrain.rl.simulate import calibrate, simulate
from leantrain.settings import load_settings
from leantrain.telemetry.report import write_benchmark_json

RESULTS = Path(__file__).parent / "results" / "async_rl.json"
MODES = {"sync": ("sync", 0), "k1": ("async", 1), "k2": ("async", 2)}


def one_run(name: str, args: argparse.Namespace, out: Path, repeat: int) -> dict[str, Any]:
    """Train one mode from the same initial weights; returns its summary."""
    mode, k = MODES[name]
    # Without --config: the tiny model on `arith`; with one, its model and task unless --model.
    base = {} if args.config else {"model.name": "tiny", "task.name": "arith"}
    if args.model is not None:
        base["model.name"] = args.model
    cfg = load_settings(
        RLConfig,
        args.config,
        **{
            **base,
            "threads": None,  # this script sets torch's threads (below)
            "task.eval_size": args.eval_size,
            "steps": args.steps,
            "seed": repeat,
            "device": "cpu",
            "out": out / f"{name}-{repeat}",
            "checkpoint_every": 10_000,  # the last step only: checkpoints are not the point
            "orchestrator.mode": mode,
            "orchestrator.max_staleness": k,
            "orchestrator.backend": args.backend,
            "orchestrator.rollout_threads": 1,
        },
    )
    # Async: this process (trainer, held-out evaluations) keeps one thread; so does the worker.
    torch.set_num_threads(args.sync_threads if mode == "sync" else 1)
    run = GRPORun(cfg, progress=False)
    summary = run.run()
    if mode == "sync":
        total = max(summary["seconds_total"], 1e-9)
        summary["generation_idle_fraction"] = 1 - summary["seconds_generating"] / total
        summary["max_observed_staleness"] = 0
    return summary


def check_simulator(
    tmp: Path, runs: dict[str, list[dict[str, Any]]]
) -> dict[str, dict[str, float]]:
    """Calibrate the cluster model on repeat 0's sync run and predict every mode's loop time;
    the error is (predicted - measured) / measured."""
    cal = calibrate(tmp / "sync-0")
    out = {}
    for name in runs:
        predicted = simulate(cal.cluster, cal.workload, MODES[name][1]).seconds
        measured = runs[name][0]["seconds_total"]
        out[name] = {
            "predicted_s": predicted,
            "measured_s": measured,
            "error": (predicted - measured) / measured,
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--config",
        type=Path,
        default=None,
        help="RLConfig YAML of the base settings (e.g. configs/smollm2-arith.yaml); the flags "
        "here still apply on top (default: the tiny model on arith, worked style)",
    )
    parser.add_argument(
        "--model", default=None, help="model preset or folder (default: the config's, or tiny)"
    )
    parser.add_argument("--quick", action="store_true", help="8 steps, 64 held-out, 1 repeat")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--eval-size", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sync-threads", type=int, default=1, help="torch threads of sync")
    parser.add_argument(
        "--backend",
        choices=("local", "process", "ray"),
        default="process",
        help="async rollout workers: spawned processes (no shared GIL; their start-up is "
        "timed), Ray actors, or threads of this process (local)",
    )
    parser.add_argument(
        "--modes",
        type=lambda text: [m.strip() for m in text.split(",") if m.strip()],
        default=list(MODES),
        help="comma-separated modes to run, a subset of sync,k1,k2 that keeps sync and k1 "
        "(default: all three; a mode left out reports null, e.g. speedup_k2)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if not {"sync", "k1"} <= set(args.modes) <= set(MODES):
        parser.error(f"--modes: a subset of {','.join(MODES)} with sync and k1, got {args.modes}")
    if args.quick:
        args.steps, args.eval_size, args.repeats = 8, 64, 1
    logging.basicConfig(level=logging.WARNING)
    base = load_settings(RLConfig, args.config) if args.config else None
    model = args.model or (base.model.name if base else "tiny")
    task = base.task.name if base else "arith"

    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in MODES if name in args.modes}
    with tempfile.TemporaryDirectory(prefix="async_rl-") as tmp:
        for repeat in range(args.repeats):
            for name in runs:
                runs[name].append(one_run(name, args, Path(tmp), repeat))
                s = runs[name][-1]
                print(f"{name} repeat {repeat}: {s['seconds_total']:.1f} s")
        simulated = check_simulator(Path(tmp), runs)

    results: dict[str, dict[str, float]] = {}
    for name, summaries in runs.items():
        results[name] = {
            "seconds": statistics.median(s["seconds_total"] for s in summaries),
            "generation_idle_fraction": statistics.median(
                s["generation_idle_fraction"] for s in summaries
            ),
            "accuracy_before": statistics.mean(s["accuracy_before"] for s in summaries),
            "accuracy": statistics.mean(s["accuracy_after"] for s in summaries),
            "max_observed_staleness": max(s["max_observed_staleness"] for s in summaries),
            "seconds_each": [s["seconds_total"] for s in summaries],
        }
    for name in ("k1", "k2"):
        if name not in results:
            continue
        results[name]["speedup"] = results["sync"]["seconds"] / results[name]["seconds"]

    table = Table(title=f"async GRPO vs sync ({model}, {task}, {args.steps} steps)")
    for col in ("mode", "wall s", "gen idle", "accuracy", "max staleness", "speedup"):
        table.add_column(col, justify="right")
    for name, row in results.items():
        table.add_row(
            name,
            f"{row['seconds']:.1f}",
            f"{row['generation_idle_fraction']:.0%}",
            f"{row['accuracy']:.1%}",
            str(row["max_observed_staleness"]),
            f"{row.get('speedup', 1.0):.2f}x",
        )
    Console().print(table)
    sim_table = Table(title="leantrain simulate, calibrated on the sync run (repeat 0)")
    for col in ("mode", "predicted s", "measured s", "error"):
        sim_table.add_column(col, justify="right")
    for name, row in simulated.items():
        sim_table.add_row(
            name, f"{row['predicted_s']:.1f}", f"{row['measured_s']:.1f}", f"{row['error']:+.0%}"
        )
    Console().print(sim_table)

    report = {
        "speedup_k1": results["k1"]["speedup"],
        "speedup_k2": results["k2"]["speedup"] if "k2" in results else None,
        "accuracy_sync": results["sync"]["accuracy"],
        "accuracy_k1": results["k1"]["accuracy"],
        "max_observed_staleness_k1": results["k1"]["max_observed_staleness"],
        "results": results,
        "simulated": simulated,
        "model": model,
        "config": {
            "model": model,
            "task": task,
            "steps": args.steps,
            "eval_size": args.eval_size,
            "repeats": args.repeats,
            "quick": args.quick,
            "sync_threads": args.sync_threads,
            "threads_per_side": 1,
            "backend": args.backend,
            "modes": list(runs),
            "config": str(args.config) if args.config else None,
        },
    }
    write_benchmark_json(args.out, report)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
