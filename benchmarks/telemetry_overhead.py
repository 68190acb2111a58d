"""What recording rollout events costs: the `leantrain demo` run (tiny model, `arith`, 128
sequences a step, sync) with `telemetry.events` on and off, one after the other in this process.

Two measures, because the cost is far below the run-to-run noise of a shared 2-core machine:
- measured directly: the seconds the run spent turning timelines into events.jsonl records and
  writing them (`summary["seconds_events"]`, timed inside `EventLog.write`), plus the engine's
  marks (always on: a few per sequence), counted in the run's events and priced by timing
  `SeqTimeline.mark` with a clock read here; their sum over the training loop's wall time is
  `overhead_fraction`;
- side by side: the training loop's wall time with events on over off (`wall_ratio_on_off`,
  medians over repeats; the engine's marks run in both).

    python benchmarks/telemetry_overhead.py            # the demo: 150 steps, 2 repeats
    python benchmarks/telemetry_overhead.py --quick    # 10 steps, 1 repeat, 16 held-out

Writes benchmarks/results/telemetry_overhead.json (keys `overhead_fraction`,
`wall_ratio_on_off`, `seconds_events`, `engine_marks`, `mark_s`, and details).
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from leantrain.cli.rl import DEMO_SETTINGS
from leantrain.rl.config import RLConfig
from leantrain.rl.grpo import GRPORun
from leantrain.settings import load_settings
from leantrain.telemetry.events import SeqTimeline, clock
from leantrain.telemetry.report import write_benchmark_json

RESULTS = Path(__file__).parent / "results" / "telemetry_overhead.json"


def one_run(events: bool, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """The demo's run with events on or off; its summary, plus the engine marks it made."""
    settings = {"steps": args.steps, "task.eval_size": args.eval_size, "telemetry.events": events}
    cfg = load_settings(RLConfig, None, **{**DEMO_SETTINGS, **settings, "out": out})
    summary = GRPORun(cfg, progress=False).run()
    if events:  # one mark per sequence span and per finish (the engine's only records)
        with (out / "events.jsonl").open() as f:
            summary["engine_marks"] = sum('"seq"' in line for line in f)
    return summary


def mark_seconds(n: int = 200_000) -> float:
    """Seconds one engine mark costs: a clock read and a `SeqTimeline.mark`."""
    timeline = SeqTimeline()
    start = time.perf_counter()
    for i in range(n):
        timeline.mark(clock(), "decode", i)
    return (time.perf_counter() - start) / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="10 steps, 1 repeat, 16 held-out")
    parser.add_argument("--steps", type=int, default=DEMO_SETTINGS["steps"])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--eval-size",
        type=int,
        default=200,
        help="held-out problems evaluated before and after (outside the timed loop)",
    )
    parser.add_argument("--keep", type=Path, help="copy the events-on run folder here")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.quick:
        args.steps, args.repeats, args.eval_size = 10, 1, 16
    logging.basicConfig(level=logging.WARNING)

    runs: dict[str, list[dict[str, Any]]] = {"on": [], "off": []}
    with tempfile.TemporaryDirectory(prefix="telemetry_overhead-") as tmp:
        for repeat in range(args.repeats):
            order = ("on", "off") if repeat % 2 == 0 else ("off", "on")  # neither always first
            for name in order:
                out = Path(tmp) / f"{name}-{repeat}"
                runs[name].append(one_run(name == "on", args, out))
                print(f"events {name}, repeat {repeat}: {runs[name][-1]['seconds_total']:.1f} s")
                if name == "on" and repeat == 0 and args.keep is not None:
                    shutil.rmtree(args.keep, ignore_errors=True)
                    shutil.copytree(out, args.keep)
    mark_s = mark_seconds()

    on, off = runs["on"], runs["off"]
    wall_on = statistics.median(s["seconds_total"] for s in on)
    wall_off = statistics.median(s["seconds_total"] for s in off)
    fractions = [
        (s["seconds_events"] + s["engine_marks"] * mark_s) / s["seconds_total"] for s in on
    ]
    report = {
        "overhead_fraction": statistics.median(fractions),
        "wall_ratio_on_off": wall_on / wall_off,
        "seconds_events": statistics.median(s["seconds_events"] for s in on),
        "engine_marks": statistics.median(s["engine_marks"] for s in on),
        "mark_s": mark_s,
        "seconds_total_on": [s["seconds_total"] for s in on],
        "seconds_total_off": [s["seconds_total"] for s in off],
        "config": {
            "steps": args.steps,
            "repeats": args.repeats,
            "quick": args.quick,
            "eval_size": args.eval_size,
            "demo_settings": {**DEMO_SETTINGS, "steps": args.steps},
        },
    }
    table = Table(title=f"event recording on the demo ({args.steps} steps, {args.repeats} repeats)")
    for col in ("measure", "value"):
        table.add_column(col, justify="right")
    table.add_row("training loop, events on (s, median)", f"{wall_on:.1f}")
    table.add_row("training loop, events off (s, median)", f"{wall_off:.1f}")
    table.add_row("wall ratio on / off", f"{report['wall_ratio_on_off']:.3f}")
    table.add_row("events.jsonl: convert + write (s)", f"{report['seconds_events']:.3f}")
    table.add_row(
        "engine marks (count x µs each)", f"{report['engine_marks']:.0f} x {mark_s * 1e6:.2f}"
    )
    table.add_row("measured overhead / wall", f"{report['overhead_fraction']:.3%}")
    Console().print(table)
    write_benchmark_json(args.out, report)
    print(f"wrote {args.out}")
    print(json.dumps({k: report[k] for k in ("overhead_fraction", "wall_ratio_on_off")}))


if __name__ == "__main__":
    main()
