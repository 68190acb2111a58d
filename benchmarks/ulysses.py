"""Ulysses sequence parallelism on CPU: P = 1, 2, 4 gloo processes, per-rank peak memory and step
time against sequence length, bytes each rank sends per layer against the paper's 4·N·h/P, and
the largest difference from the single-process model.

Model: the built-in tiny Llama (4 heads, 4 KV heads, so the 4·N·h/P formula applies as written;
h = hidden size, fp32). A step is forward + backward of the next-token loss over one sequence of
N tokens (batch 1) plus the gradient all-reduce; P=1 is the plain model (SDPA attention). Each P
runs in its own set of spawned processes, started with `MALLOC_MMAP_THRESHOLD_=65536` so the
resident set follows live memory (`leantrain.memory.measure_step`).

Bytes: each rank counts what its all-to-alls send to other ranks in forward; the share of its
own buffer it keeps is not sent, so the exact expectation is (P-1)/P · 4·N·h/P per layer (the
paper's 4·N·h/P counts the whole buffer). Backward sends the same again.

    python benchmarks/ulysses.py            # N = 1024..8192, 3 repeats
    python benchmarks/ulysses.py --quick    # N = 1024, 4096, 1 repeat; < 2 min

Writes benchmarks/results/ulysses.json (keys `max_abs_diff_vs_single`, `bytes_ratio_vs_theory`,
and `details`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from leantrain.distributed.launch import free_port
from leantrain.telemetry.report import write_benchmark_json

RESULTS = Path(__file__).parent / "results" / "ulysses.json"
WORLDS = (1, 2, 4)


def rank_worker(rank: int, world: int, port: int, lens: list[int], repeats: int, out: str) -> None:
    """One rank: for each N, a reference forward on the whole sequence, then measured steps."""
    import torch.distributed as dist

    from leantrain.distributed import COMM, SequenceParallelHooks, sequence_parallel_backward
    from leantrain.distributed.sequence import shard_batch
    from leantrain.memory import measure_step
    from leantrain.models import load_model

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model, tokenizer = load_model("tiny")
    reference, _ = load_model("tiny")
    pad = tokenizer.pad_token_id
    if world > 1:
        SequenceParallelHooks().attach(model, tokenizer)
    layers, hidden = model.config.num_hidden_layers, model.config.hidden_size
    rows = []
    for n in lens:
        ids = torch.randint(
            0, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(n)
        )
        chunks = [(ids, ids)]
        with torch.no_grad():
            ref = reference(input_ids=ids, labels=ids)
            local_ids, positions, _ = shard_batch(ids, ids, rank, world, pad)
            logits = model(input_ids=local_ids, position_ids=positions).logits
        width = logits.shape[1]
        start, stop = rank * width, min((rank + 1) * width, n)
        logit_diff = float((logits[0, : stop - start] - ref.logits[0, start:stop]).abs().max())

        def step(chunks: list = chunks) -> float:
            # P=1: one shard, the model's own attention, an all-reduce over one rank
            loss = sequence_parallel_backward(model, chunks, pad)
            model.zero_grad(set_to_none=True)
            return loss

        loss = step()  # warm-up; its loss is checked against the reference
        COMM.reset()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        sent_per_layer = COMM.forward_bytes / repeats / layers
        mem = measure_step(model, step)
        theory = 4 * n * hidden / world * 4  # fp32 bytes
        rows.append(
            {
                "seq_len": n,
                "step_s": statistics.median(times),
                "peak_bytes": mem.peak_bytes,
                "bytes_sent_per_layer": sent_per_layer,
                "theory_bytes_per_layer": theory,
                "max_abs_diff": max(logit_diff, abs(loss - float(ref.loss))),
            }
        )
    Path(out, f"rank{rank}.json").write_text(json.dumps(rows))
    dist.destroy_process_group()


def run_world(world: int, lens: list[int], repeats: int) -> list[dict]:
    """Spawn `world` ranks; per length, the worst rank's figures."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(rank_worker, args=(world, free_port(), lens, repeats, tmp), nprocs=world)
        per_rank = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world)]
    merged = []
    for rows in zip(*per_rank, strict=True):
        merged.append(
            {
                "seq_len": rows[0]["seq_len"],
                "step_s": max(r["step_s"] for r in rows),
                "peak_bytes_per_rank": max(r["peak_bytes"] for r in rows),
                "bytes_sent_per_layer": max(r["bytes_sent_per_layer"] for r in rows),
                "theory_bytes_per_layer": rows[0]["theory_bytes_per_layer"],
                "max_abs_diff": max(r["max_abs_diff"] for r in rows),
            }
        )
    return merged


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="two lengths, one repeat")
    parser.add_argument("--lens", type=int, nargs="+", help="sequence lengths")
    args = parser.parse_args()
    lens = args.lens or ([1024, 4096] if args.quick else [1024, 2048, 4096, 8192])
    repeats = 1 if args.quick else 3
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # inherited by the spawned ranks

    from rich.console import Console
    from rich.table import Table

    from leantrain.models import ensure_tiny

    ensure_tiny()  # build the preset once, before the ranks race for it
    results = {world: run_world(world, lens, repeats) for world in WORLDS}

    table = Table(title="Ulysses on CPU (tiny Llama, batch 1, fp32)")
    for col in ("P", "N", "step s", "peak MiB/rank", "sent KiB/layer", "4Nh/P KiB", "ratio"):
        table.add_column(col, justify="right")
    for world, rows in results.items():
        for r in rows:
            ratio = r["bytes_sent_per_layer"] / r["theory_bytes_per_layer"]
            table.add_row(
                str(world),
                str(r["seq_len"]),
                f"{r['step_s']:.2f}",
                f"{r['peak_bytes_per_rank'] / 2**20:.1f}",
                f"{r['bytes_sent_per_layer'] / 1024:.0f}",
                f"{r['theory_bytes_per_layer'] / 1024:.0f}",
                f"{ratio:.3f}" if world > 1 else "-",
            )
    Console().print(table)

    max_diff = max(r["max_abs_diff"] for rows in results.values() for r in rows)
    ratios = {
        f"P={world}": round(
            max(r["bytes_sent_per_layer"] / r["theory_bytes_per_layer"] for r in rows), 4
        )
        for world, rows in results.items()
        if world > 1
    }
    out = {
        "max_abs_diff_vs_single": max_diff,
        "bytes_ratio_vs_theory": ratios,
        "details": {
            "date": datetime.date.today().isoformat(),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores",
            "quick": args.quick,
            "repeats": repeats,
            "expected_ratio": {f"P={w}": round((w - 1) / w, 4) for w in WORLDS if w > 1},
            "results": {f"P={w}": rows for w, rows in results.items()},
        },
    }
    write_benchmark_json(RESULTS, out)
    print(f"max |SP - single| (logits, loss): {max_diff:.2e}; bytes/theory: {ratios}")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
