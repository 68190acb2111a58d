"""The token pipeline: packing against padding, re-tokenization drift, and the KV-cache budget.

1. Training throughput, packed against padded, on the same data and model: trajectories with
   arith's long-tailed (Pareto) lengths, one loss forward + backward per micro-batch.
   - packed (ours): first-fit-decreasing micro-batches under a token budget, each one
     padding-free row (`rl.packing.pack` + `packed_logprobs`);
   - padded (baseline, TRL's layout): the same number of micro-batches in data order, prompts
     left-padded and responses right-padded (`rl.packing.padded_logprobs`).
   Both compute the same loss (checked); tokens/s counts real tokens only, median of repeats.
2. Re-tokenization drift: responses sampled from `smollm2-135m` (chat template, temperature 1),
   decoded and encoded again with its tokenizer; the share whose ids change is the share a
   decode-then-encode pipeline would silently train on ids the policy never sampled.
3. KV budget: the engine on long-tail arith prompts, unbounded, then with `max_cache_tokens` set
   to half the unbounded peak; the budget holds if the bounded peak never passes it.

    python benchmarks/token_pipeline.py            # full: 256 trajectories, 5 repeats, 64 samples
    python benchmarks/token_pipeline.py --quick    # under 120 s on 2 idle CPU cores

Writes benchmarks/results/token_pipeline.json with keys `packing_speedup`,
`padding_fraction_padded`, `retokenize_mismatch_rate`, `kv_budget_respected`.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from leantrain.generation import Engine, SamplingParams
from leantrain.models import encode_prompt, load_model
from leantrain.rl.losses import policy_loss
from leantrain.rl.packing import (
    loss_context,
    micro_batches,
    pack,
    packed_logprobs,
    padded_logprobs,
    padding_fraction,
)
from leantrain.rl.trajectory import Trajectory
from leantrain.tasks import ArithTask, ToolArithTask
from leantrain.telemetry.report import write_benchmark_json

RESULTS = Path(__file__).parent / "results" / "token_pipeline.json"


def long_tail_trajectories(
    tokenizer: PreTrainedTokenizerBase, n: int, seed: int
) -> list[Trajectory]:
    """`n` arith problems with their worked solutions as responses (Pareto list lengths)."""
    rng = random.Random(seed)
    task = ArithTask(alpha=1.0, max_items=48)
    trajs = []
    for ex in task.examples(n, seed):
        response = [*tokenizer.encode(ex.solution), tokenizer.eos_token_id]
        trajs.append(
            Trajectory(
                prompt_ids=tokenizer.encode(ex.prompt),
                response_ids=response,
                logprobs=[rng.uniform(-3.0, -0.1) for _ in response],
                versions=[0] * len(response),
                loss_mask=[1] * len(response),
                finish_reason="eos",
            )
        )
    return trajs


def train_pass(
    model: PreTrainedModel,
    trajs: list[Trajectory],
    advantages: torch.Tensor,
    groups: list[list[int]],
    padded: bool,
) -> float:
    """One loss forward + backward over `groups` (packed rows or padded batches); the loss."""
    batches = [pack([trajs[i] for i in g], advantages[g]) for g in groups]
    ctx = loss_context(batches)
    total = 0.0
    for group, batch in zip(groups, batches, strict=True):
        if padded:
            logp = padded_logprobs(model, [trajs[i] for i in group])
        else:
            logp = packed_logprobs(model, batch)
        loss, _ = policy_loss(
            logp, batch.old_logprobs, batch.advantages, batch.loss_mask, batch.sequence_index, ctx
        )
        loss.backward()
        total += float(loss.detach())
    model.zero_grad(set_to_none=True)
    return total


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def packing_vs_padding(args: argparse.Namespace) -> dict[str, float]:
    model, tokenizer = load_model("tiny")
    model.train()
    trajs = long_tail_trajectories(tokenizer, args.trajectories, seed=0)
    advantages = torch.randn(len(trajs), generator=torch.Generator().manual_seed(0))
    packed_groups = micro_batches(trajs, args.micro_batch_tokens)
    # The baseline: as many micro-batches as packing uses, sequences in data order.
    size = math.ceil(len(trajs) / len(packed_groups))
    padded_groups = [list(range(i, min(i + size, len(trajs)))) for i in range(0, len(trajs), size)]
    loss_packed = train_pass(model, trajs, advantages, packed_groups, padded=False)
    loss_padded = train_pass(model, trajs, advantages, padded_groups, padded=True)
    if abs(loss_packed - loss_padded) > 1e-4 * max(1.0, abs(loss_packed)):
        raise RuntimeError(f"packed and padded losses differ: {loss_packed} vs {loss_padded}")
    tokens = sum(len(t.prompt_ids) + len(t.response_ids) for t in trajs)
    seconds = {}
    for name, groups, padded in (
        ("packed", packed_groups, False),
        ("padded", padded_groups, True),
    ):
        seconds[name] = median_seconds(
            lambda g=groups, p=padded: train_pass(model, trajs, advantages, g, p), args.repeats
        )
    lengths = sorted(len(t.prompt_ids) + len(t.response_ids) for t in trajs)
    return {
        "trajectories": len(trajs),
        "tokens": tokens,
        "length_p50": lengths[len(lengths) // 2],
        "length_max": lengths[-1],
        "micro_batches": len(packed_groups),
        "packed_tokens_per_s": tokens / seconds["packed"],
        "padded_tokens_per_s": tokens / seconds["padded"],
        "padding_fraction_packed": padding_fraction(trajs, packed_groups, packed=True),
        "padding_fraction_padded": padding_fraction(trajs, padded_groups, packed=False),
        "loss": loss_packed,
    }


def retokenize_drift(args: argparse.Namespace) -> dict[str, float]:
    model, tokenizer = load_model("smollm2-135m")
    examples = ToolArithTask().examples(args.samples, seed=1)
    prompts = [encode_prompt(tokenizer, ex.prompt) for ex in examples]
    params = SamplingParams(max_new_tokens=args.sample_tokens, temperature=1.0)
    completions = Engine(model, tokenizer, max_batch_size=args.samples).generate(
        prompts, params, seed=0
    )
    changed = 0
    for c in completions:
        # What a text-in pipeline trains on: the decoded text, encoded again (EOS kept apart).
        ids = [t for t in c.response_ids if t != tokenizer.eos_token_id]
        text = tokenizer.decode(ids)
        changed += tokenizer.encode(text, add_special_tokens=False) != ids
    return {"samples": len(completions), "changed": changed, "rate": changed / len(completions)}


def kv_budget(args: argparse.Namespace) -> dict[str, float]:
    model, tokenizer = load_model("tiny")
    examples = ArithTask(alpha=1.0, max_items=48).examples(args.kv_prompts, seed=2)
    prompts = [tokenizer.encode(ex.prompt) for ex in examples]
    params = SamplingParams(max_new_tokens=args.kv_new_tokens, temperature=1.0)
    free = Engine(model, tokenizer, max_batch_size=args.kv_prompts)
    free.generate(prompts, params, seed=0)
    longest = max(len(p) for p in prompts) + params.max_new_tokens
    budget = max(longest, free.peak_cache_tokens // 2)
    bounded = Engine(model, tokenizer, max_batch_size=args.kv_prompts, max_cache_tokens=budget)
    bounded.generate(prompts, params, seed=0)
    return {
        "budget": budget,
        "peak_unbounded": free.peak_cache_tokens,
        "peak_bounded": bounded.peak_cache_tokens,
        "respected": bounded.peak_cache_tokens <= budget,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes (< 120 s, 2 cores)")
    parser.add_argument("--trajectories", type=int, default=256)
    parser.add_argument("--micro-batch-tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--samples", type=int, default=64, help="smollm2 responses sampled")
    parser.add_argument("--sample-tokens", type=int, default=64)
    parser.add_argument("--kv-prompts", type=int, default=32)
    parser.add_argument("--kv-new-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.quick:
        args.trajectories, args.repeats, args.samples, args.sample_tokens = 96, 3, 24, 48
        args.kv_prompts, args.kv_new_tokens = 16, 64
    torch.set_num_threads(args.threads)

    packing = packing_vs_padding(args)
    with torch.inference_mode():
        drift = retokenize_drift(args)
        kv = kv_budget(args)
    speedup = packing["packed_tokens_per_s"] / packing["padded_tokens_per_s"]

    table = Table(title="token pipeline (tiny model; smollm2-135m tokenizer for drift)")
    for col in ("measure", "ours", "baseline", "ratio"):
        table.add_column(col, justify="right")
    table.add_row(
        f"train tokens/s ({packing['trajectories']} traj, p50 {packing['length_p50']}, "
        f"max {packing['length_max']})",
        f"{packing['packed_tokens_per_s']:.0f} packed",
        f"{packing['padded_tokens_per_s']:.0f} padded",
        f"{speedup:.2f}x",
    )
    table.add_row(
        "padding fraction",
        f"{packing['padding_fraction_packed']:.1%}",
        f"{packing['padding_fraction_padded']:.1%}",
        "",
    )
    table.add_row(
        f"ids changed by decode-then-encode ({drift['samples']} samples)",
        "0 (token-in/token-out)",
        f"{drift['changed']} ({drift['rate']:.1%})",
        "",
    )
    table.add_row(
        f"KV cache peak, tokens (budget {kv['budget']})",
        f"{kv['peak_bounded']}",
        f"{kv['peak_unbounded']} unbounded",
        "respected" if kv["respected"] else "EXCEEDED",
    )
    Console().print(table)

    report = {
        "packing_speedup": speedup,
        "padding_fraction_padded": packing["padding_fraction_padded"],
        "retokenize_mismatch_rate": drift["rate"],
        "kv_budget_respected": kv["respected"],
    }
    write_benchmark_json(args.out, report)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
