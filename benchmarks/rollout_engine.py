"""Rollout throughput: leantrain's `Engine` against Hugging Face `model.generate`.

Same model, same `arith` prompts, same sampling (temperature 1.0, no top-k/top-p, EOS-stopping,
`max_new_tokens` 256), at batch 1 and batch 16; generated tokens per second, median of repeats.

- HF `generate` runs the prompts in chunks of the batch size (left padding); a chunk lasts as long
  as its longest response, and finished rows keep decoding padding until then.
- Our engine gets the whole prompt list with `max_batch_size` = the batch size: continuous
  batching refills a finished row's slot with the next prompt. That is our design advantage, and
  it is exactly what a heavy-tailed response length (arith's Pareto list length) rewards.

Tokens are counted honestly on both sides: each response up to and including its EOS (or all
`max_new_tokens`), never padding. Sampling draws different responses on the two sides, so their
total token counts differ; tokens per second compares them fairly.

    python benchmarks/rollout_engine.py            # full: 64 prompts, 3 repeats
    python benchmarks/rollout_engine.py --quick    # under a minute on 2 CPU cores

Writes benchmarks/results/rollout_engine.json (keys `speedup_b1`, `speedup_b16`, and details).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from leantrain.generation import Engine, SamplingParams
from leantrain.tasks import ArithTask
from leantrain.telemetry.report import write_benchmark_json

RESULTS = Path(__file__).parent / "results" / "rollout_engine.json"


def load(name: str) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """`tiny` (the built-in trained preset), `random` (random-init tiny Llama) or a local path."""
    if name == "random":
        from transformers import LlamaForCausalLM

        from leantrain.models.tiny_config import tiny_config
        from leantrain.models.tokenizer import build_byte_tokenizer

        tokenizer = build_byte_tokenizer()
        torch.manual_seed(0)
        return LlamaForCausalLM(tiny_config(tokenizer)), tokenizer
    from leantrain.models import load_model

    return load_model(name)


def hf_generate(
    model: PreTrainedModel,
    prompts: list[list[int]],
    batch: int,
    max_new: int,
    eos_ids: list[int],
    pad: int,
) -> int:
    """Sample with HF `generate` in chunks of `batch`; return tokens generated (EOS inclusive)."""
    total = 0
    for start in range(0, len(prompts), batch):
        chunk = prompts[start : start + batch]
        width = max(map(len, chunk))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=max_new,
            eos_token_id=eos_ids,
            pad_token_id=pad,
        )
        for row in out[:, width:].tolist():
            ends = [i for i, t in enumerate(row) if t in eos_ids]
            total += ends[0] + 1 if ends else len(row)  # finished rows are padded after their EOS
    return total


def ours_generate(
    engine: Engine, prompts: list[list[int]], params: SamplingParams, seed: int
) -> int:
    """Sample with our engine; return the tokens generated (EOS inclusive)."""
    return sum(len(c.response_ids) for c in engine.generate(prompts, params, seed=seed))


def timed(fn: Callable[[], int]) -> tuple[float, float, int]:
    """(wall seconds, CPU seconds of this process, tokens) of one call. Wall time is the result;
    CPU time is recorded too because on a shared machine it is less disturbed by other load."""
    wall, cpu = time.perf_counter(), time.process_time()
    tokens = fn()
    return time.perf_counter() - wall, time.process_time() - cpu, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="tiny | random | path to an HF checkpoint")
    parser.add_argument("--quick", action="store_true", help="fewer prompts (< 60 s on 2 cores)")
    parser.add_argument("--prompts", type=int, default=64, help="arith prompts at batch 16")
    parser.add_argument("--prompts-b1", type=int, default=16, help="arith prompts at batch 1")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads for both sides (a ~1 M-parameter model gains nothing from "
        "more, and a busy machine makes OpenMP spin-waits dominate)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.quick:
        args.prompts, args.prompts_b1, args.repeats = 32, 8, 3
    torch.set_num_threads(args.threads)

    model, tokenizer = load(args.model)
    model.eval()
    examples = ArithTask().examples(max(args.prompts, args.prompts_b1), seed=0)
    prompts = [tokenizer.encode(ex.prompt) for ex in examples]
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=1.0)

    # Both sides stop on the same EOS ids: the tokenizer's and the model's generation config's.
    eos_ids = sorted(Engine(model, tokenizer).eos_ids)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
    hf = partial(hf_generate, model, eos_ids=eos_ids, pad=pad)

    # Warm up both paths (first-call allocations, lazily installed hooks).
    hf(prompts[:2], 2, 8)
    Engine(model, tokenizer, 2).generate(
        prompts[:2], SamplingParams(max_new_tokens=8, temperature=1.0), seed=0
    )

    results = {}
    with torch.inference_mode():
        for batch, n in ((1, args.prompts_b1), (16, args.prompts)):
            engine = Engine(model, tokenizer, max_batch_size=batch)
            runs = {"hf": [], "ours": []}
            for rep in range(args.repeats):
                torch.manual_seed(rep)  # HF samples from the global generator
                runs["hf"].append(timed(partial(hf, prompts[:n], batch, args.max_new_tokens)))
                runs["ours"].append(timed(partial(ours_generate, engine, prompts[:n], params, rep)))
            row = {"prompts": n}
            for side, measured in runs.items():
                row[f"{side}_tokens_per_s"] = statistics.median(t / w for w, _, t in measured)
                row[f"{side}_tokens_per_cpu_s"] = statistics.median(t / c for _, c, t in measured)
                row[f"{side}_tokens"] = statistics.median(t for _, _, t in measured)
                row[f"{side}_seconds"] = statistics.median(w for w, _, _ in measured)
            row["speedup"] = row["ours_tokens_per_s"] / row["hf_tokens_per_s"]
            row["speedup_cpu_time"] = row["ours_tokens_per_cpu_s"] / row["hf_tokens_per_cpu_s"]
            results[f"b{batch}"] = row

    table = Table(title=f"rollout throughput ({args.model}, max_new_tokens {args.max_new_tokens})")
    for col in (
        "batch",
        "prompts",
        "HF tok/s",
        "ours tok/s",
        "speedup",
        "HF tokens",
        "ours tokens",
    ):
        table.add_column(col, justify="right")
    for key, row in results.items():
        table.add_row(
            key[1:],
            str(row["prompts"]),
            f"{row['hf_tokens_per_s']:.0f}",
            f"{row['ours_tokens_per_s']:.0f}",
            f"{row['speedup']:.2f}x",
            f"{row['hf_tokens']:.0f}",
            f"{row['ours_tokens']:.0f}",
        )
    Console().print(table)

    report = {
        "speedup_b1": results["b1"]["speedup"],
        "speedup_b16": results["b16"]["speedup"],
        "results": results,
        "config": {
            "model": args.model,
            "parameters": sum(p.numel() for p in model.parameters()),
            "task": "arith",
            "temperature": params.temperature,
            "max_new_tokens": params.max_new_tokens,
            "repeats": args.repeats,
            "quick": args.quick,
            "threads": args.threads,
            "device": str(next(model.parameters()).device),
        },
    }
    write_benchmark_json(args.out, report)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
