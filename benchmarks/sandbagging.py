"""Sandbagging elicitation (Ryd et al., arXiv 2604.22082) on the tiny model (or SmolLM2-135M-
Instruct, `--model smollm2-135m`): lock it with a password, then elicit it without the password
by SFT on weak demonstrations, by RL (our GRPO) against a weak grader, and by SFT then RL. One
table: true `arith` accuracy without the password after each strategy, against the password
ceiling, the locked floor and the weak demonstrator.

The paper's finding to check: SFT on weak demos breaks the lock, RL then improves on it; RL alone
optimises the weak grader (which the sandbagging policy already satisfies) and elicits little.

    python benchmarks/sandbagging.py            # full settings (configs/elicit-tiny.yaml)
    python benchmarks/sandbagging.py --quick    # under 180 s on 2 idle cores
    python benchmarks/sandbagging.py --model smollm2-135m --out /tmp/sandbagging_smollm2.json
    python benchmarks/real_model.py sandbagging  # the same, to results/sandbagging_smollm2.json

On smollm2 the settings are
configs/elicit-smollm2.yaml (why each: its comments); `--config` runs any other file.

Writes benchmarks/results/sandbagging.json: `locked_acc`, `unlocked_acc`, `sft_acc`, `rl_acc`,
`sft_rl_acc`, `model`, and the details under `results`.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
import transformers
from rich.console import Console
from rich.table import Table

from leantrain.safety.config import ElicitConfig
from leantrain.safety.elicit import STRATEGIES, elicit, lock
from leantrain.settings import load_settings
from leantrain.telemetry.report import write_benchmark_json

RESULTS = Path(__file__).parent / "results" / "sandbagging.json"
# The settings per model (the tiny model's: ElicitConfig's defaults, configs/elicit-tiny.yaml).
CONFIGS = {"smollm2-135m": Path(__file__).parents[1] / "configs" / "elicit-smollm2.yaml"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="fewer locking and RL steps (tiny model only)"
    )
    parser.add_argument(
        "--model", choices=("tiny", *CONFIGS), default="tiny", help="the model locked"
    )
    parser.add_argument(
        "--config", type=Path, default=None, help="ElicitConfig YAML (default: the model's)"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    transformers.utils.logging.disable_progress_bar()  # ours is the only bar on screen
    config = ElicitConfig()
    if args.config or args.model in CONFIGS:
        config = load_settings(ElicitConfig, args.config or CONFIGS[args.model])
    if args.quick:
        if config.model != "tiny":
            parser.error("--quick is the tiny model's short run; for another, pass --config")
        config = ElicitConfig(lock_steps=200, rl_steps=12, eval_size=60)
    start = time.perf_counter()
    seconds, summaries = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        locked = Path(tmp) / "locked"
        t0 = time.perf_counter()
        lock_info = lock(config, locked, progress=False)
        seconds["lock"] = round(time.perf_counter() - t0, 1)
        for strategy in STRATEGIES:
            t0 = time.perf_counter()
            summaries[strategy] = elicit(
                config, locked, strategy, Path(tmp) / strategy, progress=False
            )
            seconds[strategy] = round(time.perf_counter() - t0, 1)

    table = Table(
        title=f"sandbagging elicitation ({config.model}, arith, no password at test time)"
    )
    for col in ("model", "true accuracy", "weak-grader pass", "seconds"):
        table.add_column(col, justify="right")
    table.add_row(
        "with password (ceiling)",
        f"{lock_info['unlocked']['accuracy']:.0%}",
        f"{lock_info['unlocked']['grader_pass']:.0%}",
        "",
    )
    table.add_row(
        "locked (floor)",
        f"{lock_info['locked']['accuracy']:.0%}",
        f"{lock_info['locked']['grader_pass']:.0%}",
        str(seconds["lock"]),
    )
    table.add_row("weak demonstrator", f"{lock_info['weak_demonstrator_accuracy']:.0%}", "", "")
    for strategy, s in summaries.items():
        table.add_row(
            f"after {strategy}",
            f"{s['after']['accuracy']:.0%}",
            f"{s['after']['grader_pass']:.0%}",
            str(seconds[strategy]),
        )
    Console().print(table)

    report = {
        "model": config.model,
        "locked_acc": lock_info["locked"]["accuracy"],
        "unlocked_acc": lock_info["unlocked"]["accuracy"],
        "sft_acc": summaries["sft"]["after"]["accuracy"],
        "rl_acc": summaries["rl"]["after"]["accuracy"],
        "sft_rl_acc": summaries["sft+rl"]["after"]["accuracy"],
        "results": {"lock": lock_info, **summaries},
        "config": {
            **config.model_dump(),
            "quick": args.quick,
            "threads": args.threads,
            "seconds": seconds,
            "seconds_total": round(time.perf_counter() - start, 1),
        },
    }
    write_benchmark_json(args.out, report)
    print(f"wrote {args.out} in {report['config']['seconds_total']} s")


if __name__ == "__main__":
    main()
