"""Where the native engine's rollout time goes: per phase, and per operator class.

One `Engine.generate` of chat-templated `arith` prompts on SmolLM2-135M in bf16 (the issue-28
case), timed per phase by wrapping the engine's own methods (prefill forwards, decode forwards,
which include prompts joining a running batch, sampling, dropping finished rows; the rest is
Python bookkeeping and stop checks), then once more under `torch.profiler` for the share of
each operator class (matmuls, attention, elementwise, copies). The docs' before/after table
(docs/backends.md, "The native engine's speed") ran this script at two commits.

    python benchmarks/engine_profile.py            # b64 greedy and b16 sampled, 64 prompts
    python benchmarks/engine_profile.py --quick    # 16 prompts, 32 new tokens

Writes benchmarks/results/engine_profile.json.
"""

from __future__ import annotations

import argparse
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table
from torch.profiler import profile

import leantrain.generation.engine as engine_module
from leantrain.generation import Engine, SamplingParams
from leantrain.models import encode_prompt, load_model, resolve_model_path
from leantrain.tasks import ArithTask
from leantrain.telemetry.report import write_benchmark_json

RESULTS = Path(__file__).parent / "results" / "engine_profile.json"

# Operator classes by aten/mkldnn name (a name matching none is "other").
OP_CLASSES = {
    "matmuls": ("mm", "addmm", "bmm", "linear_pointwise"),
    "attention": ("scaled_dot_product",),
    "elementwise and norms": ("mul", "add", "silu", "pow", "neg", "rsqrt", "rms_norm", "div"),
    "copies and gathers": ("copy_", "index", "cat", "_to_copy"),
    "sampling reductions": ("max", "argmax", "log_softmax", "cumsum", "exp", "searchsorted"),
}


def op_class(name: str) -> str:
    """The class of an operator named like `aten::mul` or `mkldnn::_linear_pointwise`."""
    op = name.split("::")[-1]
    for cls, stems in OP_CLASSES.items():
        if any(op == s or op.lstrip("_").startswith(s.lstrip("_")) for s in stems):
            return cls
    return "other"


def timed(spent: Counter, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn`, adding its wall time to spent[name]."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        result = fn(*args, **kwargs)
        spent[name] += time.perf_counter() - t0
        return result

    return wrapper


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="16 prompts, 32 new tokens")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.quick:
        args.prompts, args.max_new_tokens = 16, 32
    torch.set_num_threads(args.threads)

    model, tokenizer = load_model(resolve_model_path("smollm2-135m"), dtype="bfloat16")
    prompts = [
        encode_prompt(tokenizer, ex.prompt) for ex in ArithTask().examples(args.prompts, seed=0)
    ]
    spent: Counter = Counter()
    phases = {
        "prefill forwards": (engine_module.Engine, "_prefill"),
        "decode forwards (with joining prompts)": (engine_module.Engine, "_decode"),
        "dropping finished rows": (engine_module._Batch, "keep"),
        "sampling": (engine_module, "sample"),
    }
    originals = {name: getattr(owner, attr) for name, (owner, attr) in phases.items()}
    for name, (owner, attr) in phases.items():
        setattr(owner, attr, timed(spent, name, originals[name]))

    results: dict[str, Any] = {}
    table = Table(title=f"native engine, SmolLM2-135M bf16, {args.prompts} prompts")
    for col in ("case", "phase or op class", "seconds", "share"):
        table.add_column(col, justify="right")
    for batch, temperature in ((64, 0.0), (16, 1.0)):
        case = f"b{batch}_{'greedy' if temperature == 0 else 'sampled'}"
        engine = Engine(model, tokenizer, max_batch_size=batch)
        params = SamplingParams(temperature=temperature, max_new_tokens=args.max_new_tokens)
        engine.generate(prompts[:2], SamplingParams(max_new_tokens=4), seed=0)  # warm-up
        spent.clear()
        t0 = time.perf_counter()
        completions = engine.generate(prompts, params, seed=0)
        total = time.perf_counter() - t0
        tokens = sum(len(c.response_ids) for c in completions)
        row = dict(spent)
        row["other (Python bookkeeping, stop checks)"] = total - sum(spent.values())
        with profile() as prof:
            engine.generate(prompts, params, seed=0)
        ops: Counter = Counter()
        for event in prof.key_averages():
            ops[op_class(event.key)] += event.self_cpu_time_total / 1e6
        op_total = sum(ops.values())
        results[case] = {
            "total_s": total,
            "tokens": tokens,
            "tokens_per_s": tokens / total,
            "phases_s": row,
            "op_share": {k: v / op_total for k, v in ops.most_common()},
        }
        print(f"{case}: {tokens / total:.1f} tok/s, {total:.2f} s", flush=True)
        for name, seconds in row.items():
            table.add_row(case, name, f"{seconds:.2f}", f"{seconds / total:.0%}")
        for name, share in results[case]["op_share"].items():
            table.add_row(case, f"ops: {name}", "", f"{share:.0%}")
    for name, (owner, attr) in phases.items():
        setattr(owner, attr, originals[name])
    Console().print(table)
    report = {
        **{f"tokens_per_s_{case}": r["tokens_per_s"] for case, r in results.items()},
        "results": results,
        "config": {
            "model": "smollm2-135m",
            "dtype": "bfloat16",
            "task": "arith, chat template",
            "prompts": args.prompts,
            "max_new_tokens": args.max_new_tokens,
            "threads": args.threads,
            "quick": args.quick,
        },
    }
    write_benchmark_json(args.out, report)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
