"""Peak memory of one fine-tuning step against sequence length: full fine-tuning, LoRA, LoRA with
activation checkpointing, LoRA with the lean kernels, LARS with stock kernels, LARS and
LoRA+LARS, on the same model, batch and tokens.

Each method runs in its own fresh process (so no method inherits another's allocator state),
started with `MALLOC_MMAP_THRESHOLD_=65536` so glibc returns every freed tensor to the OS and the
resident set follows live memory. Per sequence length (ascending) the process takes one unmeasured
step (the optimizer allocates its state there), then one measured step: forward, backward,
optimizer step. Peak = resident-set high-water mark of the measured step minus the resident set
before it (`leantrain.memory.measure_step`); the exact bytes autograd saved for backward are
counted beside it. Inputs are the same random token ids for every method (batch 1, loss on every
token). The method setup is `leantrain tune`'s own (`SFTRun`), LoRA r=8 and LARS rank 8 on every
projection.

LARS (`lars`, `lora+lars`) runs with the lean kernels (`leantrain.memory.kernels`: a SiLU product
and RMSNorm that keep fewer tensors, exact gradients), as `leantrain tune` does. They would help
LoRA too, so two more rows split the gain: `lora+lean` (LoRA with the same kernels) and
`lars-stock` (LARS without them). The issue's target compares `lars` with plain `lora` (PEFT
LoRA, the paper's baseline).

Where the saved bytes go: at the first length each process also lists every tensor autograd
saves (`leantrain.memory.probe.saved_tensors`) and sums, for one middle decoder layer, the
numbers kept per token by part (norms, attention, projection inputs, SwiGLU intermediates), in
units of the hidden size d.

Accuracy beside memory: each method also runs an SFT config, picked by model (`--sft-config`),
and reports held-out greedy accuracy (skipped by `--quick`), at the learning rate that suits it:

- `tiny`: `configs/tiny-sft.yaml` (SFT on `arith` worked solutions, 40 steps): 5e-4 when the
  full weights train (full, lars; 2e-3 degrades the half-trained tiny model), 2e-3 for LoRA
  adapters (every lora row). Any other model without its own entry also takes this config.
- `smollm2-135m`: `configs/smollm2-sft.yaml` (SFT on `arith` in chat style, the number alone,
  30 steps of 8): 5e-5 for full weights, 5e-4 for LoRA adapters. Chosen before any run, not
  tuned on the held-out set: 5e-5 is a usual full-SFT rate for a pretrained model of this size
  (a pretrained model takes far smaller steps than the half-trained tiny one), and LoRA's best
  rate is commonly about 10x full fine-tuning's (adapters start at zero; B is zero-initialised).

The issue 27 check on smollm2 is the third command below (LARS against PEFT LoRA only, three
lengths): about 30 min on 2 busy cores, estimated from step timings, not yet run end to end:
about 15 for the memory steps (most of it the two 4096-token steps per method) and 11 for the
accuracy runs (per method two 200-problem evaluations, about 3 min, and 30 steps, 2.5 min).

    python benchmarks/memory.py            # lengths 256..4096, accuracy after the config's steps
    python benchmarks/memory.py --quick    # lengths 256..4096 (fewer), no accuracy; < 2 min
    python benchmarks/memory.py --model smollm2-135m --lens 1024 2048 4096 --methods lora,lars \
        --out benchmarks/results/lars_smollm2.json

Writes benchmarks/results/memory.json or `--out` (keys `lars_vs_lora_mem_ratio_longest`,
`seq_lens`, `model` and `details`) and a .png beside it. `--methods` must keep `lora` and `lars`
(the headline ratio); `--sft-steps` shortens the accuracy runs (smoke runs only).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from rich.table import Table

from leantrain.telemetry.report import write_benchmark_json

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results" / "memory.json"
CONFIG = ROOT / "configs" / "tiny-sft.yaml"
# Row name -> TuneConfig overrides. lean_kernels None is tune's default: on for the lars methods.
METHODS = {
    "full": {"method": "full"},
    "lora": {"method": "lora"},
    "lora+ckpt": {"method": "lora", "gradient_checkpointing": True},
    "lora+lean": {"method": "lora", "lean_kernels": True},
    "lars-stock": {"method": "lars", "lean_kernels": False},
    "lars": {"method": "lars"},
    "lora+lars": {"method": "lora+lars"},
}
ADAPTER_LR = 2e-3  # LoRA adapters start at zero and take a larger rate than the full weights
# Model -> (SFT config, LoRA adapters' rate); the config's own `lr` is the full weights'. Models
# not listed take the tiny entry (the config's model name is replaced by --model).
SFT = {
    "tiny": (CONFIG, ADAPTER_LR),
    "smollm2-135m": (ROOT / "configs" / "smollm2-sft.yaml", 5e-4),
}
# Parts of a decoder layer's saved tensors, by the module that saved them (first match wins).
PARTS = (
    ("norms", "norm"),
    ("proj inputs", "_proj"),  # LoRA's lora_A/lora_B inputs, LARS's coordinates
    ("attention", "self_attn"),  # SDPA's q, k, v, output; RoPE
    ("SwiGLU", "mlp"),  # SiLU and the product of gate and up
)


def layer_parts(saved: list, layer: int, unit_bytes: int) -> dict[str, float]:
    """Bytes autograd saved, per part of decoder layer `layer` (and their sum, "layer") and
    outside every layer, divided by `unit_bytes` (one d-wide vector per token: numbers per token
    in units of d)."""
    prefix = f"layers.{layer}."
    parts = dict.fromkeys([name for name, _ in PARTS] + ["other", "outside"], 0.0)
    for t in saved:
        if ".layers." not in f".{t.module}":
            parts["outside"] += t.nbytes / unit_bytes
        elif prefix in t.module:
            suffix = t.module.split(prefix, 1)[1]
            part = next((name for name, key in PARTS if key in suffix), "other")
            parts[part] += t.nbytes / unit_bytes
    parts["layer"] = sum(v for name, v in parts.items() if name != "outside")
    return {name: round(v, 2) for name, v in parts.items()}


def worker(method: str, model: str, lens: list[int], sft: dict[str, Any], accuracy: bool) -> None:
    """Measure `method` at each length, print one JSON line per result; then, if `accuracy`, the
    SFT run of `sft` (config, the adapters' lr, steps or None). The config also gives the method's
    sizes (LoRA r, LARS rank, targets) for the memory steps."""
    import torch

    from leantrain.memory import measure_step, saved_tensors
    from leantrain.memory.config import TuneConfig
    from leantrain.memory.sft import SFTRun
    from leantrain.models.finetune import backward_token_mean
    from leantrain.settings import load_settings

    torch.set_num_threads(1)
    config_path = Path(sft["config"])
    with tempfile.TemporaryDirectory() as tmp:
        overrides = {**METHODS[method], "model.name": model, "device": "cpu"}
        cfg = load_settings(
            TuneConfig, config_path, out=Path(tmp) / "mem", eval_size=1, **overrides
        )
        run = SFTRun(cfg, progress=False)
        vocab = run.model.get_input_embeddings().num_embeddings
        generator = torch.Generator().manual_seed(0)
        run.model.train()
        for n in lens:
            ids = torch.randint(0, vocab, (1, n), generator=generator)

            def step(ids: torch.Tensor = ids) -> None:
                backward_token_mean(run.model, [(ids, ids)])
                run.loop.optimizer.step()
                run.loop.optimizer.zero_grad(set_to_none=True)

            if n == lens[0]:  # also the first-touch step: optimizer state, buffers
                config = run.model.config
                unit = n * config.hidden_size * next(run.model.parameters()).element_size()
                saved = saved_tensors(run.model, step)
                parts = layer_parts(saved, config.num_hidden_layers // 2, unit)
                print(json.dumps({"parts": parts, "parts_seq_len": n}), flush=True)
            else:
                step()  # unmeasured: first touch of this length's buffers
            mem = measure_step(run.model, step)
            print(json.dumps({"seq_len": n, **mem.__dict__}), flush=True)
        if accuracy:
            if cfg.method.startswith("lora"):
                overrides["lr"] = sft["adapter_lr"]
            if sft["steps"] is not None:
                overrides["steps"] = sft["steps"]
            cfg = load_settings(TuneConfig, config_path, out=Path(tmp) / "acc", **overrides)
            summary = SFTRun(cfg, progress=False).run()
            row = {
                "accuracy": summary["accuracy_after"],
                "accuracy_before": summary["accuracy_before"],
            }
            row.update(lr=cfg.lr, sft_steps=cfg.steps, sft_seconds=summary["seconds_training"])
            print(json.dumps(row), flush=True)


def measure(method: str, model: str, lens: list[int], sft: dict[str, Any], accuracy: bool) -> dict:
    """Run `worker` for `method` in a fresh process; its results by kind."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    args = [sys.executable, __file__, "--worker", method, "--model", model]
    args += ["--lens", *map(str, lens), *([] if accuracy else ["--no-accuracy"])]
    args += ["--sft-config", str(sft["config"]), "--adapter-lr", str(sft["adapter_lr"])]
    args += [] if sft["steps"] is None else ["--sft-steps", str(sft["steps"])]
    done = subprocess.run(args, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{method} worker failed:\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    accuracy = next((r for r in rows if "accuracy" in r), {"accuracy": None})
    parts = next(r for r in rows if "parts" in r)
    return {"steps": [r for r in rows if "seq_len" in r], **accuracy, **parts}


def slope(lens: list[int], values: list[float]) -> float | None:
    """Least-squares slope of `values` against `lens` (bytes per token); None from one length."""
    if len(set(lens)) < 2:
        return None
    mx, my = sum(lens) / len(lens), sum(values) / len(values)
    num = sum((x - mx) * (y - my) for x, y in zip(lens, values, strict=True))
    return num / sum((x - mx) ** 2 for x in lens)


def plot(results: dict, lens: list[int], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for method, res in results.items():
        ax.plot(lens, [s["peak_bytes"] / 2**20 for s in res["steps"]], marker="o", label=method)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length (tokens, batch 1)")
    ax.set_ylabel("peak step memory (MiB)")
    ax.set_title("Fine-tuning step memory vs sequence length")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def parts_table(results: dict, model: str) -> Table:
    """Numbers saved per token for backward by each part of a middle decoder layer, in d."""
    first = next(iter(results.values()))
    table = Table(
        title=f"saved for backward per token, middle layer, in d ({model}, "
        f"{first['parts_seq_len']} tokens; checkpointing: layer inputs, not seen)"
    )
    table.add_column("method", min_width=10)
    # "other" (a layer's tensor saved by no known part) is shown only when something landed there
    shown = [
        part
        for part in [*(name for name, _ in PARTS), "other", "layer", "outside"]
        if part != "other" or any(r["parts"]["other"] for r in results.values())
    ]
    for part in shown:
        table.add_column(part, justify="right")
    for method, r in results.items():
        table.add_row(method, *(f"{r['parts'][part]:.2f}" for part in shown))
    return table


def shown_path(path: Path) -> str:
    """`path` relative to the repository when inside it (as the results have always shown)."""
    try:
        return str(Path(path).resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer lengths, no accuracy runs")
    parser.add_argument("--model", default="tiny", help="preset or local HF folder")
    parser.add_argument("--lens", type=int, nargs="+", help="sequence lengths (ascending)")
    parser.add_argument("--no-accuracy", action="store_true", help="skip the accuracy runs")
    parser.add_argument(
        "--methods",
        default=",".join(METHODS),
        help=f"comma-separated rows to measure, a subset of {','.join(METHODS)} that keeps lora "
        "and lars (default: all)",
    )
    parser.add_argument(
        "--sft-config",
        type=Path,
        help="TuneConfig YAML of the accuracy runs (default by model: configs/smollm2-sft.yaml "
        "for smollm2-135m, configs/tiny-sft.yaml otherwise); also sets LoRA/LARS sizes",
    )
    parser.add_argument(
        "--adapter-lr",
        type=float,
        help="learning rate of LoRA adapters in the accuracy runs (default by model: 2e-3 tiny, "
        "5e-4 smollm2-135m); full weights take the config's lr",
    )
    parser.add_argument(
        "--sft-steps", type=int, help="override the SFT config's steps (smoke runs)"
    )
    parser.add_argument("--out", type=Path, default=RESULTS, help="results JSON (.png beside)")
    parser.add_argument("--worker", choices=METHODS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    lens = args.lens or ([256, 1024, 4096] if args.quick else [256, 512, 1024, 2048, 4096])
    with_accuracy = not (args.quick or args.no_accuracy)
    default_config, default_lr = SFT.get(args.model, SFT["tiny"])
    sft = {
        "config": args.sft_config or default_config,
        "adapter_lr": default_lr if args.adapter_lr is None else args.adapter_lr,
        "steps": args.sft_steps,
    }
    if args.worker:
        worker(args.worker, args.model, lens, sft, with_accuracy)
        return
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = sorted(set(methods) - set(METHODS))
    if unknown or not {"lora", "lars"} <= set(methods):
        problem = f"unknown {', '.join(unknown)}" if unknown else "needs lora and lars"
        parser.error(f"--methods: {problem} (a subset of {','.join(METHODS)})")
    methods = [m for m in METHODS if m in methods]  # the table's order

    from rich.console import Console
    from rich.progress import Progress

    from leantrain.models import resolve_model_path

    resolve_model_path(args.model)  # build the tiny preset once, before the workers race
    results = {}
    with Progress(transient=True) as bar:
        job = bar.add_task("methods", total=len(methods))
        for method in methods:
            bar.update(job, description=f"measuring {method}")
            results[method] = measure(method, args.model, lens, sft, with_accuracy)
            bar.advance(job)

    peaks = {m: [s["peak_bytes"] for s in r["steps"]] for m, r in results.items()}
    slopes = {m: slope(lens, p) for m, p in peaks.items()}
    lora_last = peaks["lora"][-1]
    table = Table(title=f"peak step memory (MiB), model {args.model}, batch 1")
    table.add_column("method")
    for n in lens:
        table.add_column(str(n), justify="right")
    table.add_column(f"vs LoRA @{lens[-1]}", justify="right")
    table.add_column("KiB/token", justify="right")
    table.add_column("accuracy", justify="right")
    for method, p in peaks.items():
        acc = results[method]["accuracy"]
        table.add_row(
            method,
            *(f"{b / 2**20:.1f}" for b in p),
            f"{p[-1] / lora_last:.2f}x",
            "-" if slopes[method] is None else f"{slopes[method] / 1024:.1f}",
            "-" if acc is None else f"{acc:.1%}",
        )
    console = Console()
    console.print(table)
    console.print(parts_table(results, args.model))

    ratio = peaks["lars"][-1] / lora_last
    saved_lora_last = results["lora"]["steps"][-1]["saved_activation_bytes"]
    out = {
        "lars_vs_lora_mem_ratio_longest": round(ratio, 4),
        "seq_lens": lens,
        "model": args.model,
        "details": {
            "date": datetime.date.today().isoformat(),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores",
            "model": args.model,
            "quick": args.quick,
            "mem_ratio_longest_vs_lora": {m: round(p[-1] / lora_last, 4) for m, p in peaks.items()},
            "saved_bytes_ratio_longest_vs_lora": {
                m: round(r["steps"][-1]["saved_activation_bytes"] / saved_lora_last, 4)
                for m, r in results.items()
            },
            "slope_bytes_per_token": {m: s and round(s) for m, s in slopes.items()},
            "lars_vs_lora_slope_ratio": round(slopes["lars"] / slopes["lora"], 4)
            if slopes["lars"] is not None
            else None,
            "accuracy_config": shown_path(sft["config"]) if with_accuracy else None,
            "results": results,
        },
    }
    if with_accuracy:
        out["details"]["accuracy_lars_minus_lora"] = round(
            results["lars"]["accuracy"] - results["lora"]["accuracy"], 4
        )
    write_benchmark_json(args.out, out)
    plot(results, lens, args.out.with_suffix(".png"))
    print(f"LARS / LoRA peak at {lens[-1]} tokens: {ratio:.3f}  (target <= 0.67)")
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
