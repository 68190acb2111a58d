"""Two leantrain commands on one machine: how much each slows against running alone, with the
default thread count (each command's share of the usable cores, followed while it runs;
`leantrain.training.threads`) and with torch's own default (every process takes every core).

The command is a short GRPO run on the tiny model (`leantrain rl`, 3 steps). Alone: it runs by
itself. Side by side: a second copy starts `--stagger` seconds after the first, as a job started
beside a running one (the first took every core when it started alone). Each command's time is
its wall time from start to exit; the slowdown is the slower copy's over the median alone, and
the figure is the median over repeats. Every run uses a fresh `LEANTRAIN_HOME` register, so
commands outside the benchmark do not count.

    python benchmarks/two_processes.py            # 3 repeats
    python benchmarks/two_processes.py --quick    # 1 repeat

Writes benchmarks/results/two_processes.json (keys `slowdown_shared`, `slowdown_all_cores`,
`seconds_alone`, and each run's seconds).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from leantrain.settings import leantrain_home
from leantrain.telemetry.report import write_benchmark_json
from leantrain.training.threads import usable_cores

RESULTS = Path(__file__).parent / "results" / "two_processes.json"
ROOT = Path(__file__).resolve().parents[1]


def command(out: Path, threads: int | None) -> list[str]:
    """The measured command: 3 GRPO steps of 8 prompts x 8 samples, 96 tokens, 20 test problems."""
    leantrain = Path(sys.executable).parent / "leantrain"
    line = [str(leantrain), "rl", "--config", str(ROOT / "configs" / "tiny-arith.yaml")]
    line += ["--steps", "3", "--out", str(out), "-o", "task.eval_size=20"]
    line += ["-o", "grpo.prompts_per_step=8", "-o", "sampling.max_new_tokens=96"]
    # the config pins 2 threads (the same figures on any machine): unpinned, the command's share
    return [*line, "-o", "threads=null" if threads is None else f"threads={threads}"]


def run_once(tmp: Path, threads: int | None, copies: int, stagger: float) -> list[float]:
    """`copies` commands, each `stagger` s after the previous; each one's seconds from its start
    to its exit (polled, so a copy that ends first is timed when it ends)."""
    home = tmp / f"home-{time.monotonic_ns()}"
    shutil.copytree(leantrain_home() / "models", home / "models", dirs_exist_ok=True)
    env = {**os.environ, "LEANTRAIN_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    env.pop("OMP_NUM_THREADS", None)  # the environment's count would pin every copy
    lines = [(command(tmp / f"run-{home.name}-{i}", threads), i * stagger) for i in range(copies)]
    start = time.perf_counter()
    procs = []
    for line, delay in lines:
        time.sleep(max(0.0, start + delay - time.perf_counter()))
        procs.append(
            (subprocess.Popen(line, env=env, stdout=subprocess.DEVNULL), time.perf_counter())
        )
    ended: dict[int, float] = {}
    deadline = time.perf_counter() + 900
    while len(ended) < copies:
        if time.perf_counter() > deadline:
            raise TimeoutError("a benchmark command ran past 900 s")
        for i, (proc, _) in enumerate(procs):
            if i not in ended and proc.poll() is not None:
                if proc.returncode != 0:
                    raise RuntimeError(f"{' '.join(proc.args)} exited with {proc.returncode}")
                ended[i] = time.perf_counter()
        time.sleep(0.05)
    return [ended[i] - began for i, (_, began) in enumerate(procs)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 repeat")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--stagger", type=float, default=3.0, help="seconds between the starts")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.quick:
        args.repeats = 1
    cores = usable_cores()
    subprocess.run(
        [str(Path(sys.executable).parent / "leantrain"), "preset", "tiny"],
        check=True,
        stdout=subprocess.DEVNULL,
    )  # the shipped build in place once, so no run pays for it

    alone, shared, all_cores = [], [], []
    with tempfile.TemporaryDirectory(prefix="two_processes-") as tmp:
        for repeat in range(args.repeats):
            alone += run_once(Path(tmp), None, 1, 0.0)
            shared.append(run_once(Path(tmp), None, 2, args.stagger))
            all_cores.append(run_once(Path(tmp), cores, 2, args.stagger))
            print(
                f"repeat {repeat}: alone {alone[-1]:.1f} s, side by side (shares) "
                f"{shared[-1][0]:.1f} / {shared[-1][1]:.1f} s, side by side ({cores} threads "
                f"each) {all_cores[-1][0]:.1f} / {all_cores[-1][1]:.1f} s"
            )
    seconds_alone = statistics.median(alone)
    report: dict[str, Any] = {
        "slowdown_shared": statistics.median(max(pair) for pair in shared) / seconds_alone,
        "slowdown_all_cores": statistics.median(max(pair) for pair in all_cores) / seconds_alone,
        "seconds_alone": seconds_alone,
        "seconds_alone_runs": alone,
        "seconds_shared_runs": shared,
        "seconds_all_cores_runs": all_cores,
        "config": {
            "cores": cores,
            "repeats": args.repeats,
            "stagger_s": args.stagger,
            "quick": args.quick,
            "command": " ".join(command(Path("OUT"), None)[1:]),
        },
    }
    table = Table(title=f"two leantrain commands on {cores} cores (medians of {args.repeats})")
    for col in ("threads per command", "alone (s)", "side by side, slower copy (s)", "slowdown"):
        table.add_column(col, justify="right")
    for name, pairs, key in (
        ("its share (default)", shared, "slowdown_shared"),
        (f"{cores}, every core (torch's default)", all_cores, "slowdown_all_cores"),
    ):
        table.add_row(
            name,
            f"{seconds_alone:.1f}",
            f"{statistics.median(max(pair) for pair in pairs):.1f}",
            f"{report[key]:.2f}x",
        )
    Console().print(table)
    write_benchmark_json(args.out, report)
    print(f"wrote {args.out}")
    print(json.dumps({k: report[k] for k in ("slowdown_shared", "slowdown_all_cores")}))


if __name__ == "__main__":
    main()
