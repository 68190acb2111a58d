"""The GRPO learner data-parallel on 2 gloo ranks (FSDP2) against 1 process: the largest weight
difference after the same steps, learner tokens/s on 1 and 2 ranks, and the bytes each rank's
gradient reduction moves per step against the analytic figure. Then the same 2 ranks
sequence-parallel (`distributed.sequence_parallel_size: 2`, Ulysses: both ranks split every
micro-batch's row): its largest weight difference from 1 process after the same steps.

Model: the built-in tiny preset, fp32, on CPU. Workload: fixed synthetic trajectories (16 a step,
prompts and responses of uneven lengths, dapo loss), the same on both sides; a step is
`Learner.step` (rank 0 broadcasts the batch, the ranks train their micro-batches, FSDP reduces
the gradients, rank 0's copy takes the new weights). Rollouts are not timed.

Bytes: each rank counts what FSDP's collectives move (wrapping `all_gather_single` and
`reduce_scatter_single`): a reduce-scatter of an S-byte buffer over W ranks sends (W-1)/W * S
from each rank. Gradients are reduced once a step (sync only after the last micro-batch), so the
theory is (W-1)/W * 4 bytes * trainable parameters (FSDP pads each to a multiple of W, hence a
ratio a little above 1). The all-gathers (forward, backward, rank 0's full copy) are reported
beside it.

On this machine both ranks share 2 cores with whatever else runs, so the 2-rank tokens/s says
what the communication costs here, not what 2 GPUs would gain.

Data parallelism runs every micro-batch's forward exactly as one process does, so its weights
differ only by the order of float sums. Sequence parallelism computes attention per packed
sequence on a rank's heads, a different kernel order: its gradients differ from one process by
rounding (about 1e-7 in fp32, tests/distributed/test_sequence_parallel_learner.py), and Adam's
division by sqrt(v) enlarges that on gradient elements near zero, so expect `max_abs_diff_sp2`
above `max_abs_diff_2rank`.

    python benchmarks/distributed.py            # 2 warm-up + 10 timed steps
    python benchmarks/distributed.py --quick    # 1 warm-up + 3 timed steps; < 3 min
    python benchmarks/distributed.py --quick --out /tmp/distributed.json   # anywhere else

Writes benchmarks/results/distributed.json unless `--out` says where.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from leantrain.distributed.launch import spawn_ranks
from leantrain.telemetry.report import write_benchmark_json

RESULTS = Path(__file__).parent / "results" / "distributed.json"
WORLD = 2
RANKS_TIMEOUT_S = 600  # both ranks: every step twice (data-parallel, then SP=2), on shared cores
TRAJECTORIES = 16


def _config(steps: int, sequence_parallel: int = 1, device: str = "cpu"):
    from leantrain.rl.config import RLConfig

    return RLConfig(
        steps=steps,
        distributed={"sequence_parallel_size": sequence_parallel},
        device=device,
        model={"dtype": "float32"},  # the learner in fp32 (bf16 autocast on CUDA otherwise)
        grpo={
            "prompts_per_step": TRAJECTORIES // 4,
            "group_size": 4,
            "lr": 1e-4,
            "warmup_steps": 0,
            "loss_type": "dapo",
            "micro_batch_tokens": 256,
        },
        sampling={"max_new_tokens": 64, "temperature": 1.0},
    )


def _batches(steps: int, vocab: int) -> list:
    """`steps` batches of synthetic trajectories, behaviour logprobs near -2 (ratios spread
    around 1 on the preset, so some tokens clip)."""
    from leantrain.rl.trajectory import Trajectory

    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(steps):
        rows = []
        for i in range(TRAJECTORIES):
            p, r = (int(n) for n in torch.randint(8, 65, (2,), generator=g))
            rows.append(
                Trajectory(
                    prompt_ids=torch.randint(1, vocab, (p,), generator=g).tolist(),
                    response_ids=torch.randint(1, vocab, (r,), generator=g).tolist(),
                    logprobs=(-2.0 + 0.5 * torch.randn(r, generator=g)).tolist(),
                    versions=[0] * r,
                    loss_mask=[1] * r,
                    finish_reason="stop",
                    reward=float(torch.rand((), generator=g) < 0.5),
                    group_id=i // 4,
                )
            )
        batches.append(rows)
    return batches


def _train(
    world,
    steps: int,
    warmup: int,
    sequence_parallel: int = 1,
    model: str = "tiny",
    device: str = "cpu",
) -> dict:
    """`warmup` + `steps` learner steps on `world` (None: one process on `device`); rank 0's
    timings and final weights (on the CPU). `model`: a preset or a local HF folder
    (benchmarks/gpu_check.py passes its random-init 1B Llama and CUDA)."""
    from leantrain.models import load_model
    from leantrain.rl.learner import Learner

    where = world.device if world is not None else torch.device(device)
    torch.manual_seed(0)
    policy, tokenizer = load_model(model, device=str(where), dtype="float32")
    config = _config(warmup + steps, sequence_parallel, where.type)
    learner = Learner(config, policy, where, world)
    batches = _batches(warmup + steps, len(tokenizer))
    seconds = []
    for i, batch in enumerate(batches):
        start = time.perf_counter()
        learner.step(batch if world is None or world.is_main else None)
        if i >= warmup:
            seconds.append(time.perf_counter() - start)
    tokens = sum(len(t.prompt_ids) + len(t.response_ids) for b in batches[warmup:] for t in b)
    result = {"step_s": seconds, "tokens_per_s": tokens / sum(seconds)}
    if learner.policy is not None:
        result["weights"] = {
            k: v.detach().to("cpu", copy=True) for k, v in learner.policy.state_dict().items()
        }
        result["params"] = sum(p.numel() for p in learner.policy.parameters() if p.requires_grad)
    return result


def rank_worker(rank: int, steps: int, warmup: int, out: str) -> None:
    """One of the 2 ranks: the same steps as the single process, counting FSDP's bytes; then
    the same steps again with both ranks sequence-parallel (not counted)."""
    import torch.distributed as dist

    from leantrain.distributed import join, leave

    torch.set_num_threads(1)
    world = join(torch.device("cpu"), timeout_s=300)
    sent = {"reduce_scatter": 0, "all_gather": 0}
    counting = {"count": False}
    all_gather, reduce_scatter = dist.all_gather_single, dist.reduce_scatter_single

    def counted_all_gather(output, input, *args, **kwargs):
        if counting["count"]:  # what this rank receives from the others
            sent["all_gather"] += output.numel() * output.element_size() * (WORLD - 1) // WORLD
        return all_gather(output, input, *args, **kwargs)

    def counted_reduce_scatter(output, input, *args, **kwargs):
        if counting["count"]:  # what this rank sends to the others
            sent["reduce_scatter"] += input.numel() * input.element_size() * (WORLD - 1) // WORLD
        return reduce_scatter(output, input, *args, **kwargs)

    dist.all_gather_single, dist.reduce_scatter_single = counted_all_gather, counted_reduce_scatter
    counting["count"] = True
    result = _train(world, steps, warmup)
    counting["count"] = False
    sequence_parallel = _train(world, steps, warmup, sequence_parallel=WORLD)
    if world.is_main:
        steps_run = warmup + steps
        result["bytes_per_step"] = {k: v / steps_run for k, v in sent.items()}
        torch.save(result, Path(out) / "two.pt")
        torch.save(sequence_parallel, Path(out) / "sp.pt")
    leave()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 warm-up + 3 timed steps")
    parser.add_argument(
        "--out", type=Path, default=RESULTS, help=f"where to write the JSON (default {RESULTS})"
    )
    args = parser.parse_args()
    warmup, steps = (1, 3) if args.quick else (2, 10)
    load = os.getloadavg()[0]  # other work on the shared cores: read the timings with it
    torch.set_num_threads(1)

    from rich.console import Console
    from rich.table import Table

    from leantrain.models import ensure_tiny

    ensure_tiny()  # build the preset once, before the ranks race for it
    one = _train(None, steps, warmup)
    with tempfile.TemporaryDirectory() as out:
        codes = spawn_ranks(rank_worker, (steps, warmup, out), RANKS_TIMEOUT_S, WORLD)
        if codes != [0] * WORLD:
            raise SystemExit(f"a rank failed or ran past {RANKS_TIMEOUT_S} s: exit codes {codes}")
        two = torch.load(Path(out) / "two.pt")
        sp = torch.load(Path(out) / "sp.pt")

    max_diff = max((one["weights"][k] - v).abs().max().item() for k, v in two["weights"].items())
    sp_diff = max((one["weights"][k] - v).abs().max().item() for k, v in sp["weights"].items())
    theory = (WORLD - 1) / WORLD * 4 * one["params"]
    reduced = two["bytes_per_step"]["reduce_scatter"]
    table = Table(title="GRPO learner, tiny preset, fp32, dapo, 16 trajectories a step")
    for col in ("ranks", "step s (median)", "tokens/s"):
        table.add_column(col, justify="right")
    for ranks, r in ((1, one), (WORLD, two), (f"{WORLD}, SP={WORLD}", sp)):
        table.add_row(
            str(ranks), f"{statistics.median(r['step_s']):.3f}", f"{r['tokens_per_s']:.0f}"
        )
    Console().print(table)
    print(
        f"max |2 ranks - 1 process| weights: {max_diff:.2e}; sequence-parallel (SP={WORLD}): "
        f"{sp_diff:.2e}; gradient reduce-scatter "
        f"{reduced / 2**20:.2f} MiB/step/rank vs theory {theory / 2**20:.2f} MiB "
        f"(ratio {reduced / theory:.4f}); all-gathers "
        f"{two['bytes_per_step']['all_gather'] / 2**20:.2f} MiB/step/rank"
    )
    report = {
        "max_abs_diff_2rank": max_diff,
        "max_abs_diff_sp2": sp_diff,
        "tokens_per_s_1rank": round(one["tokens_per_s"], 1),
        "tokens_per_s_2rank": round(two["tokens_per_s"], 1),
        "allreduce_bytes_per_step": round(reduced),
        "bytes_ratio_vs_theory": round(reduced / theory, 4),
        "details": {
            "date": datetime.date.today().isoformat(),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores shared by both ranks",
            "load_average_1min_at_start": round(load, 2),
            "quick": args.quick,
            "warmup_steps": warmup,
            "timed_steps": steps,
            "trainable_params": one["params"],
            "theory_bytes_per_step": round(theory),
            "allgather_bytes_per_step": round(two["bytes_per_step"]["all_gather"]),
            "step_s_1rank": [round(s, 4) for s in one["step_s"]],
            "step_s_2rank": [round(s, 4) for s in two["step_s"]],
            "step_s_sp2": [round(s, 4) for s in sp["step_s"]],
            "tokens_per_s_sp2": round(sp["tokens_per_s"], 1),
            "max_abs_diff_sp2": "largest weight difference from 1 process after the same steps, "
            "both ranks splitting every micro-batch (distributed.sequence_parallel_size: 2)",
        },
    }
    write_benchmark_json(args.out, report)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
