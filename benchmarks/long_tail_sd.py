"""Long-tail speculative decoding (TLT): the rollout phase of a GRPO step with and without
adaptive speculation, on the same policy, prompts and seed.

One `GRPORun` on the `arith` task provides the policy, the prompts (`prompts_per_step` x
`group_size`) and the sampling (temperature 0.7, as RL samples). Each repeat (its own RL step:
prompts and seed) times its rollout phase twice, alternating which side goes first: plainly (the
engine as is) and with `LongTail`
speculation (suffix + cached warm-started EAGLE drafters, bandit-chosen draft length, only while
at most `threshold` sequences are live). Before timing, `--warmup` untimed speculative rollouts
of other prompts stand for the earlier RL steps whose rewards the bandit has already seen.
Reported:

- rollout phase wall time, and its tail: from the first step with an empty queue and at most
  `threshold` live sequences to the end (timed the same way on both sides);
- mean acceptance length (accepted drafts + 1 per verified row-step);
- the end-to-end RL step: rollout + scoring + one timed policy update (the update is the same
  on both sides, so it is measured once, after all rollouts, to keep the policy fixed for them);
- greedy_identical: greedy rollouts with and without speculation match token for token;
- tail tokens per second, speculative over plain: the two sides sample different responses
  (lossless in distribution, not in path), so wall-time ratios also carry their lengths.

The drafter is not trained online here (`train_drafter` off): on a 2-core CPU a background
trainer takes cores from the rollout it is timed against; TLT trains on otherwise idle GPUs.

Both sides roll out with the fp32 policy by default; `--dtype bfloat16` makes them roll out
with a bf16 copy of it, as RL engines roll out next to an fp32 trainer. On this CPU bf16 decoding
is memory-bound (oneDNN's AVX512-BF16 kernels: a forward over 5 tokens of one row costs about
1.15x one token's; fp32's MKL kernels over a few rows are compute-bound, about 1.6x), but bf16
sums depend on how many tokens a forward holds, so greedy outputs with and without
speculation can differ where two tokens nearly tie (`greedy_identical` says so).

    python benchmarks/long_tail_sd.py                  # smollm2-135m, 8 prompts x 4, 3 repeats
    python benchmarks/long_tail_sd.py --quick          # 4 prompts x 4, 1 repeat, < 180 s
    python benchmarks/long_tail_sd.py --model tiny     # the tiny model beside it
    python benchmarks/long_tail_sd.py --quick --dtype bfloat16  # bf16 rollouts
    python benchmarks/long_tail_sd.py --device cuda --model <HF folder>  # TLT's regime (not
                                                                        # run here: no GPU)

Writes benchmarks/results/long_tail_sd.json (other models: long_tail_sd_<model>.json) with keys
`model`, `tail_speedup`, `rollout_speedup`, `mean_accept_len`, `greedy_identical`.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table
from transformers import PreTrainedModel

from leantrain.generation import Engine, SamplingParams, Speculator
from leantrain.models import encode_prompt
from leantrain.rl.config import RLConfig
from leantrain.rl.grpo import GRPORun
from leantrain.settings import load_settings
from leantrain.speculation.config import SpeculativeConfig
from leantrain.speculation.long_tail import LongTail
from leantrain.speculation.speculator import BanditSpeculator
from leantrain.telemetry.report import write_benchmark_json

RESULTS = Path(__file__).parent / "results"


@dataclass
class Rollout:
    """One timed rollout phase."""

    seconds: float
    tail_s: float
    tokens: int
    tail_tokens: int
    accept_len: float
    sample: tuple  # (examples, completions), for the policy update


def timed_rollout(run: GRPORun, step: int) -> Rollout:
    """One rollout phase with whatever speculator the run's rollout engine holds."""
    start = time.perf_counter()
    sample = run.source.sample(step)
    seconds = time.perf_counter() - start
    s = run.source.backend.speculator.stats
    return Rollout(seconds, s.tail_s, s.tokens, s.tail_tokens, s.mean_accept_len, sample)


def ratio(values: dict[str, float]) -> float | None:
    """plain / speculative, None if either side is 0 (e.g. a rollout that never had a tail)."""
    return values["plain"] / values["speculative"] if min(values.values()) > 0 else None


def greedy_identical(
    run: GRPORun, model: PreTrainedModel, speculator: Speculator, prompts: int, max_new: int
) -> bool:
    """Greedy rollouts of `prompts` held-out problems by `model` match with and without
    speculation."""
    ids = [encode_prompt(run.tokenizer, ex.prompt) for ex in run.test_examples[:prompts]]
    params = SamplingParams(max_new_tokens=max_new, temperature=0)
    plain = Engine(model, run.tokenizer, max_batch_size=len(ids)).generate(ids, params)
    spec = Engine(model, run.tokenizer, max_batch_size=len(ids), speculator=speculator)
    fast = spec.generate(ids, params)
    return [c.response_ids for c in plain] == [c.response_ids for c in fast]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", help="preset or HF folder")
    parser.add_argument("--quick", action="store_true", help="4 prompts x 4, one repeat")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per RL step")
    parser.add_argument("--group-size", type=int, default=4, help="responses per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--threshold", type=int, default=8, help="speculate at <= this many live")
    parser.add_argument(
        "--draft-lengths", type=int, nargs="+", default=[0, 2, 4, 6], help="bandit arms (0: off)"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--warmup", type=int, default=1, help="untimed speculative rollouts before (bandit)"
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="torch intra-op threads (default: one per core)"
    )
    parser.add_argument(
        "--dtype",
        choices=("bfloat16", "float32"),
        default="float32",
        help="rollout weights (both sides): the fp32 policy, or a bf16 copy of it",
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda", "auto"),
        default="cpu",
        help="where both sides roll out (the issue's target is set on 2 CPU cores)",
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.quick:
        args.prompts, args.repeats = 4, 1
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    args.threads = torch.get_num_threads()
    name = args.model.replace("/", "_")
    out = args.out or RESULTS / (
        "long_tail_sd.json" if args.model == "smollm2-135m" else f"long_tail_sd_{name}.json"
    )

    with tempfile.TemporaryDirectory() as tmp:
        config = load_settings(
            RLConfig,
            None,
            **{
                "model.name": args.model,
                "device": args.device,
                "out": Path(tmp) / "run",
                "grpo.prompts_per_step": args.prompts,
                "grpo.group_size": args.group_size,
                "sampling.max_new_tokens": args.max_new_tokens,
                "sampling.temperature": args.temperature,
                "max_batch_size": args.prompts * args.group_size,
                "task.eval_size": 8,
            },
        )
        run = GRPORun(config, progress=False)
        # Both sides roll out with the same model: the policy, or a bf16 copy of it if asked (as
        # vLLM and SGLang roll out next to an fp32 trainer); the update stays fp32.
        rollout_model = (
            run.model if args.dtype == "float32" else copy.deepcopy(run.model).to(torch.bfloat16)
        )
        run.source.backend = Engine(
            rollout_model, run.tokenizer, max_batch_size=config.max_batch_size
        )
        spec_config = SpeculativeConfig(
            enabled=True, threshold=args.threshold, draft_lengths=args.draft_lengths
        )
        long_tail = LongTail(spec_config, rollout_model, run.tokenizer, args.model)
        # The plain side times its tail with a disabled speculator (same threshold, no drafts).
        observer = BanditSpeculator(spec_config.model_copy(update={"enabled": False}), {})
        identical = greedy_identical(
            run, rollout_model, long_tail.speculator, 8, 64 if args.quick else 128
        )

        # In a run the bandit carries what it learnt from step to step; an untimed rollout
        # (an earlier RL step, other prompts) lets it stop exploring blindly, as it would have.
        run.source.backend.speculator = long_tail.speculator
        for step in range(1, args.warmup + 1):
            run.source.sample(step)
        runs: dict[str, list] = {"plain": [], "speculative": []}
        sides = {"plain": observer, "speculative": long_tail.speculator}
        for rep in range(args.repeats):
            # Each repeat times both sides on its own prompts and seed (an RL step after the
            # warm-up ones), so the medians are over different samples, not one sample again.
            step = 0 if rep == 0 else args.warmup + rep
            order = list(sides) if rep % 2 == 0 else list(reversed(sides))
            for side in order:
                run.source.backend.speculator = sides[side]
                runs[side].append(timed_rollout(run, step=step))
        start = time.perf_counter()
        trajectories = run.source.score(*runs["plain"][0].sample, run.version)
        run.learner.step(trajectories)
        update_s = time.perf_counter() - start

    def median(field: str) -> dict[str, float]:
        return {side: statistics.median(getattr(r, field) for r in runs[side]) for side in runs}

    rollout, tail, tokens, tail_tokens = (
        median(f) for f in ("seconds", "tail_s", "tokens", "tail_tokens")
    )
    accept = median("accept_len")["speculative"]
    rl_step = {side: rollout[side] + update_s for side in runs}
    # Sampling draws different responses on the two sides (lossless in distribution, not in
    # path), so tail lengths differ; tokens per second in the tail is the steadier figure.
    tail_rate = {side: tail_tokens[side] / tail[side] if tail[side] else 0.0 for side in runs}
    # speculative / plain tail tokens per second: not skewed by the sides' response lengths
    tail_rate_speedup = None if ratio(tail_rate) is None else 1 / ratio(tail_rate)
    report = {
        "model": args.model,
        "rollout_dtype": args.dtype,
        "device": str(run.device),
        "threads": args.threads,
        "tail_speedup": ratio(tail),
        "rollout_speedup": ratio(rollout),
        "mean_accept_len": accept,
        "greedy_identical": identical,
        "tail_tokens_per_s_speedup": tail_rate_speedup,
    }

    table = Table(
        title=f"long-tail speculation ({args.model}, {args.dtype} rollouts, "
        f"{args.prompts}x{args.group_size}, {args.threads} thread(s))"
    )
    for col in ("", "plain", "speculative", "speedup"):
        table.add_column(col, justify="right")
    rows = (
        ("rollout phase s", rollout, ratio(rollout)),
        (f"tail (<= {args.threshold} live) s", tail, ratio(tail)),
        ("RL step s (rollout + update)", rl_step, ratio(rl_step)),
        ("tail tokens/s", tail_rate, tail_rate_speedup),
        ("tokens", tokens, None),
        ("tokens in the tail", tail_tokens, None),
    )
    for label, values, speedup in rows:
        cells = [f"{values[side]:.2f}" for side in ("plain", "speculative")]
        table.add_row(label, *cells, "" if speedup is None else f"{speedup:.2f}x")
    Console().print(table)
    print(
        f"mean acceptance length {accept:.2f}; greedy identical: {identical}; policy update "
        f"{update_s:.1f} s; arms chosen: {long_tail.speculator.stats.arms}"
    )
    write_benchmark_json(out, report)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
