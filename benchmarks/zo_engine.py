"""ZO fine-tuning as an inference workload: MeZO's reference loop against our engine.

Same model, same `sentiment` batches, same seeds, same number of steps, for both ZO targets:
LoRA factors over the frozen base (MeZO's LoRA mode, the paper's setting) and all parameters.

- Baseline (`leantrain.zo.reference.MeZOReference`): the reference code's step: global reseed,
  `torch.normal` and an out-of-place rebinding per tensor, two padded forwards with the model's own
  loss over full logits, `.item()`, a second reseed and per-tensor update.
- Ours (`leantrain.zo.engine.ZOEngine`): inference mode, fused in-place moves with z regenerated
  from the same seeds (drawn once per step where the buffer holds it), and scoring as an
  inference engine does it: the batch packed into the tree of its distinct prefixes (a prefix
  rows share is computed once, no padding; `leantrain.zo.packed`), the last layer and lm_head
  only where a token is scored; with LoRA every perturbed state of a step scored in one forward
  (stacked adapters). How much packing saves depends on the data: the JSON's `packing` gives the
  tokens a forward runs on each side.

Steps of the two sides alternate (baseline step i, our step i, ...), so a busy machine slows both
alike; steps per second is 1 / the median step time (wall clock; the process's CPU time is
recorded too, since on a shared machine it is less disturbed by other load). Peak memory is the
parameters plus the peak of tensors allocated during one step (the allocation profiler on a CPU,
the CUDA allocator on a GPU), next to a plain inference forward over the same batch. The loss
trajectories are compared state by state. Also: first-order AdamW fine-tuning on the same task
(memory of one step and held-out accuracy), and, unless --quick, smollm2-135m zero-shot vs ZO
accuracy.

    python benchmarks/zo_engine.py            # 200 steps per side and target, AdamW, smollm2
    python benchmarks/zo_engine.py --quick    # under two minutes on 2 idle CPU cores

With vLLM installed (`make vllm`), a full run (or `--vllm`, also with --quick) adds a third
side on the LoRA target: our engine with its states scored on an in-process vLLM engine
(`zo.backend: vllm`), the paper's setting: `speedup_vllm_vs_mezo` (steps/s against MeZO's loop)
and, under `vllm`, against our engine and the losses against the reference.

    python benchmarks/zo_engine.py --quick --vllm --out /tmp/zo_engine.json

Writes benchmarks/results/zo_engine.json (or --out): `speedup` (LoRA target),
`peak_mem_ratio_vs_inference` (ours, LoRA target), `same_losses` (both targets), with vLLM
`speedup_vllm_vs_mezo`, and details.

Time to accuracy on a pretrained model (`--model smollm2-135m`; issue 27, `benchmarks/
real_model.py zo`): the two sides as `leantrain zo` runs them, two `ZORun`s from
`configs/smollm2-zo.yaml` (LoRA on `sentiment`; `zo.engine: reference` and `inference`), from the
same start on the same batches and seeds, steps alternating. Every --eval-every steps and after
the last, each side's accuracy on the same test examples, with the clocks stopped (evaluation
time is in neither side's time). The target is fixed before training: the zero-shot accuracy +
--target-gain (5 points); a side's time to it is its summed step time, wall clock and process
CPU, up to the first evaluation at or above it; a side that never gets there is "not reached"
(null), never extrapolated. Both sides walk the same loss trajectory, so they reach it at the
same evaluation unless a near-tie flips; what differs is the time a step takes.

    python benchmarks/zo_engine.py --model smollm2-135m    # 150 steps: 35 min at load 5 on 2 cores
    python benchmarks/zo_engine.py --model smollm2-135m --steps 2 --eval-size 10 --eval-every 1

Writes benchmarks/results/zo_smollm2.json (or --out): `model`, `target_accuracy`,
`zero_shot_accuracy`, `accuracy_after` (per side), `ours_seconds_to_target`,
`mezo_seconds_to_target` (and `_cpu_`), `time_to_accuracy_ratio` (MeZO's time / ours; also
`_cpu_time`), the steps/s `speedup`, `same_losses`, `peak_mem_ratio_vs_inference`, `curves`.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from leantrain.models import load_model
from leantrain.models.finetune import backward_token_mean, completion_chunks
from leantrain.tasks import Example, make_task
from leantrain.telemetry.report import write_benchmark_json
from leantrain.zo.data import Pair, example_pairs, label_accuracy, pad_pairs, sample_batch
from leantrain.zo.engine import ZOEngine
from leantrain.zo.estimators import SPSA
from leantrain.zo.lora import add_lora, lora_factors
from leantrain.zo.packed import LeanLlama, PrefixTree
from leantrain.zo.reference import MeZOReference
from leantrain.zo.scoring import VLLMScorer, make_scorer

RESULTS = Path(__file__).parent / "results" / "zo_engine.json"
# --model (time to accuracy): the run's settings, and where it writes.
SMOLLM2_ZO_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "smollm2-zo.yaml"
TIME_TO_ACCURACY_RESULTS = Path(__file__).parent / "results" / "zo_smollm2.json"
# MeZO's settings: eps 1e-3 for full parameters, 1e-2 with LoRA (lr scaled to the tiny model).
SETTINGS = {"lora": {"eps": 1e-2, "lr": 1e-3}, "all": {"eps": 1e-3, "lr": 1e-4}}
SMOLLM2 = {"eps": 1e-2, "lr": 1e-4}  # MeZO's LoRA eps; lr above its 5e-5 for a short run
# Losses of the two sides may differ only by float summation order (the loss is summed in
# another order over micro-batches); ZO signals |L+ - L-| / L are far above this.
SAME_LOSS_RTOL = 1e-4


def _length(pair: Pair) -> int:
    return len(pair.prompt) + len(pair.completion)


def peak_bytes(fn: Callable[[], object], device: torch.device) -> int:
    """Peak bytes of tensors allocated while `fn` runs, above what was allocated before."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    sizes: list[tuple[int, int]] = []  # (time, +bytes allocated / -bytes freed)
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation:
            sizes.append((node.start_time_ns, node.extra_fields.alloc_size))
        stack.extend(node.children)
    live = peak = 0
    for _, size in sorted(sizes):
        live += size
        peak = max(peak, live)
    return peak


def build(base: PreTrainedModel, target: str, seed: int) -> PreTrainedModel:
    """A fresh copy of `base` set up for `target`; the same seed gives the same LoRA init."""
    model = copy.deepcopy(base)
    torch.manual_seed(seed)
    if target == "lora":
        return add_lora(model, r=8, alpha=16, targets=["q_proj", "v_proj"])
    return model.requires_grad_(True)


def make_stepper(
    kind: str, model: PreTrainedModel, target: str, pad: int, seed: int, backend: Any = None
):
    """`reference`: MeZO's loop; `ours`: our engine; `vllm`: our engine scoring on `backend`."""
    s = SETTINGS[target]
    if kind == "reference":
        return MeZOReference(model, s["eps"], s["lr"], seed, pad)
    scorer = VLLMScorer(backend, model) if kind == "vllm" else None
    return ZOEngine(
        model, SPSA(s["eps"]), s["lr"], seed, pad, batched=target == "lora", scorer=scorer
    )


def race(
    base: PreTrainedModel,
    pad: int,
    train: list[Pair],
    target: str,
    steps: int,
    batch_size: int,
    seed: int,
    kinds: tuple[str, ...] = ("reference", "ours"),
    backend: Any = None,
) -> dict[str, Any]:
    """The sides `kinds` for `steps` alternating steps on the same batches; times, losses,
    models (`backend`: the vLLM engine of the `vllm` side)."""
    sides = {}
    for kind in kinds:
        model = build(base, target, seed)
        stepper = make_stepper(kind, model, target, pad, seed, backend)
        sides[kind] = {"model": model, "stepper": stepper}

    def stepper_step(stepper: Any) -> Callable[[int], list[float]]:
        return lambda step: (
            stepper.step(sample_batch(train, batch_size, seed * 100_003 + step)).losses
        )

    timed = alternate({kind: stepper_step(side["stepper"]) for kind, side in sides.items()}, steps)
    for kind, side in sides.items():
        side.update(timed[kind])
    return sides


def alternate(
    sides: dict[str, Callable[[int], list[float]]],
    steps: int,
    every: int = 0,
    checkpoint: Callable[[int], None] | None = None,
) -> dict[str, dict[str, list]]:
    """Step i of each side in turn (`sides`: step index -> the losses of its scored states), so
    that a busy machine slows every side alike; the wall-clock and process CPU time of each step.
    With `every`, `checkpoint(steps done)` is called after every `every`-th step and the last,
    outside the timed region."""
    timed: dict[str, dict[str, list]] = {
        kind: {"times": [], "cpu_times": [], "losses": []} for kind in sides
    }
    for step in range(steps):
        for kind, step_fn in sides.items():
            start, cpu = time.perf_counter(), time.process_time()
            losses = step_fn(step)
            timed[kind]["times"].append(time.perf_counter() - start)
            timed[kind]["cpu_times"].append(time.process_time() - cpu)
            timed[kind]["losses"].append(losses)
        if checkpoint is not None and every and ((step + 1) % every == 0 or step + 1 == steps):
            checkpoint(step + 1)
    return timed


def step_rates(ref: dict[str, Any], ours: dict[str, Any]) -> dict[str, float]:
    """Each side's steps per second (1 / the median step time) and the CPU-time speedup."""
    return {
        "reference_steps_per_s": 1 / statistics.median(ref["times"]),
        "ours_steps_per_s": 1 / statistics.median(ours["times"]),
        "speedup_cpu_time": statistics.median(ref["cpu_times"])
        / statistics.median(ours["cpu_times"]),
    }


def loss_agreement(reference: list[list[float]], ours: list[list[float]]) -> dict[str, Any]:
    """How closely two sides' per-step losses (every scored state) agree, against the ZO signal
    |L+ - L-| / L+ that a step must resolve."""
    flat_ref = [x for step in reference for x in step]
    flat_ours = [x for step in ours for x in step]
    rel = max(abs(a - b) / abs(a) for a, b in zip(flat_ref, flat_ours, strict=True))
    return {
        "max_rel_loss_diff": rel,
        "median_rel_zo_signal": statistics.median(abs(p - m) / abs(p) for p, m, *_ in reference),
        "same_losses": rel <= SAME_LOSS_RTOL,
    }


def padded_inputs(batch: list[Pair], pad: int, device: torch.device) -> dict[str, torch.Tensor]:
    """The batch as the reference's forward takes it: padded ids, attention mask, labels."""
    ids, labels = pad_pairs(batch, pad)
    lengths = torch.tensor([_length(p) for p in batch])
    mask = (torch.arange(ids.shape[1]) < lengths[:, None]).long()
    return {
        "input_ids": ids.to(device),
        "attention_mask": mask.to(device),
        "labels": labels.to(device),
    }


def prefix_sharing(
    base: PreTrainedModel, pad: int, batches: list[list[Pair]], seed: int
) -> dict[str, float]:
    """Scoring alone, LoRA target (CPU time, median over batches): the reference's two padded
    forwards against our one packed forward of both states, over the batch's own prefix tree and
    over the same rows each put behind its own first token, so that no prefix is shared: how much
    of the speedup comes from what this data's rows share."""
    model = build(base, "lora", seed)
    lean = LeanLlama(model)
    stacks = {f: torch.stack([f.weight, f.weight]) for f in lora_factors(model)}
    reference = MeZOReference(model, 1.0, 0.0, seed, pad)
    device = next(base.parameters()).device
    vocab = model.get_input_embeddings().num_embeddings
    times: dict[str, list[float]] = {"reference": [], "tree": [], "no_sharing": []}
    nodes: dict[str, list[int]] = {"tree": [], "no_sharing": []}
    with torch.inference_mode():
        for batch in batches:
            alone = [Pair([(3 + r) % vocab, *p.prompt], p.completion) for r, p in enumerate(batch)]
            inputs = padded_inputs(batch, pad, device)
            start = time.process_time()
            reference.forward(inputs)  # the + state
            reference.forward(inputs)  # the - state
            times["reference"].append(time.process_time() - start)
            for kind, rows in (("tree", batch), ("no_sharing", alone)):
                tree = PrefixTree.build(rows, device)
                start = time.process_time()
                lean.logprobs(tree, stacks)
                times[kind].append(time.process_time() - start)
                nodes[kind].append(tree.nodes)
    ref = statistics.median(times["reference"])
    return {
        "scoring_speedup_cpu_time": ref / statistics.median(times["tree"]),
        "scoring_speedup_no_shared_prefix_cpu_time": ref / statistics.median(times["no_sharing"]),
        "no_shared_prefix_nodes": statistics.median(nodes["no_sharing"]),
    }


def memory(
    base: PreTrainedModel, pad: int, batch: list[Pair], target: str, seed: int
) -> dict[str, int]:
    """Peak bytes of one step of each side, and of a plain inference forward over the same batch,
    each from a fresh copy of the model built inside the measured region (so the parameters, the
    ones the baseline re-allocates and our z buffer all count)."""
    device = next(base.parameters()).device
    inputs = padded_inputs(batch, pad, device)
    del inputs["labels"]  # a plain forward

    def run(kind: str) -> None:
        model = build(base, target, seed)
        if kind == "inference":
            with torch.inference_mode():
                model(**inputs)
        else:
            make_stepper(kind, model, target, pad, seed).step(batch)

    out = {}
    for kind in ("reference", "ours", "inference"):
        run(kind)  # warm-up: lazily built kernels and caches are not the step's
        out[kind] = peak_bytes(lambda k=kind: run(k), device)
    return out


def adamw(
    base: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    train: list[Pair],
    heldout: list[Example],
    labels: tuple[str, ...],
    steps: int,
    batch_size: int,
    seed: int,
) -> dict[str, float]:
    """First-order fine-tuning (all parameters, AdamW lr 1e-3): peak memory of a step (grads
    and optimizer state included) and held-out accuracy after `steps` steps."""
    device = next(base.parameters()).device
    model = copy.deepcopy(base).requires_grad_(True).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(index: int) -> float:
        batch = sample_batch(train, batch_size, seed * 100_003 + index)
        chunks = completion_chunks(
            [(p.prompt, p.completion) for p in batch], tokenizer.pad_token_id, chunks=1
        )
        loss = backward_token_mean(model, chunks)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    # The model's copy is made outside the measured step: add its parameters back.
    resident = sum(p.numel() * p.element_size() for p in model.parameters())
    peak = resident + peak_bytes(lambda: step(0), device)
    start = time.perf_counter()
    for index in range(1, steps):
        step(index)
    seconds = time.perf_counter() - start
    model.eval()
    return {
        "peak_bytes": peak,
        "accuracy": label_accuracy(model, tokenizer, heldout, labels),
        "steps": steps,
        "steps_per_s": (steps - 1) / seconds if steps > 1 else float("nan"),
    }


def smollm2(steps: int, batch_size: int, eval_size: int, seed: int) -> dict[str, Any]:
    """MeZO-style LoRA ZO on smollm2-135m, `sentiment`: zero-shot vs ZO held-out accuracy."""
    model, tokenizer = load_model("smollm2-135m")
    task = make_task("sentiment")
    train = example_pairs(tokenizer, task.examples(512, seed))
    heldout = task.examples(eval_size, seed + 1_000_003)
    zero_shot = label_accuracy(model, tokenizer, heldout, task.labels)
    torch.manual_seed(seed)
    model = add_lora(model, r=8, alpha=16, targets=["q_proj", "v_proj"])
    engine = ZOEngine(
        model, SPSA(SMOLLM2["eps"]), SMOLLM2["lr"], seed, tokenizer.pad_token_id, batched=True
    )
    losses = []
    start = time.perf_counter()
    for step in range(steps):
        losses.append(engine.step(sample_batch(train, batch_size, seed * 100_003 + step)).loss)
    seconds = time.perf_counter() - start
    return {
        "steps": steps,
        **SMOLLM2,
        "zero_shot_accuracy": zero_shot,
        "zo_accuracy": label_accuracy(model, tokenizer, heldout, task.labels),
        "eval_size": eval_size,
        "first_losses": losses[:5],
        "last_losses": losses[-5:],
        "seconds": seconds,
    }


def time_to_accuracy(
    model: str,
    steps: int | None,
    every: int,
    target_gain: float,
    eval_size: int,
    seed: int,
    device: str,
) -> dict[str, Any]:
    """MeZO's loop against our engine in time to a held-out accuracy, as `leantrain zo` runs them:
    two `ZORun`s from `configs/smollm2-zo.yaml` (model `model`; `zo.engine: reference` and
    `inference`), so model, LoRA init, data, batches and seeds are the CLI's. Steps alternate;
    every `every` steps (and after the last) each side's accuracy on the same `eval_size` test
    examples is measured with the clocks stopped. The target, fixed before training: the
    zero-shot accuracy + `target_gain`; a side's time to it is its summed step time (wall and
    process CPU) up to the first evaluation at or above it, None when none is."""
    from leantrain.settings import load_settings
    from leantrain.zo.config import ZOConfig
    from leantrain.zo.run import ZORun

    runs: dict[str, ZORun] = {}
    with tempfile.TemporaryDirectory(prefix="zo-tta-") as tmp:
        for kind, engine in (("reference", "reference"), ("ours", "inference")):
            overrides = {"model.name": model, "task.eval_size": eval_size, "seed": seed}
            overrides.update({"device": device, "zo.engine": engine, "save": "none"})
            overrides["out"] = Path(tmp) / kind
            if steps is not None:
                overrides["steps"] = steps
            runs[kind] = ZORun(load_settings(ZOConfig, SMOLLM2_ZO_CONFIG, **overrides))
        cfg = runs["ours"].config
        start = [dict(run.model.named_parameters()) for run in runs.values()]
        if any(not torch.equal(p, start[1][name]) for name, p in start[0].items()):
            raise RuntimeError("the two runs do not start from the same weights")

        def accuracy(run: ZORun) -> float:
            return label_accuracy(run.model, run.tokenizer, run.heldout_examples, run.labels)

        # Both start from the same weights (LoRA's B is zero): one zero-shot measurement.
        zero_shot = accuracy(runs["ours"])
        target = zero_shot + target_gain
        print(f"zero-shot {zero_shot:.1%}, target {target:.1%}", flush=True)
        curves: dict[str, list[dict[str, float]]] = {kind: [] for kind in runs}

        def checkpoint(done: int) -> None:
            for kind, run in runs.items():
                curves[kind].append({"step": done, "accuracy": accuracy(run)})
            line = ", ".join(f"{k} {c[-1]['accuracy']:.1%}" for k, c in curves.items())
            print(f"step {done}/{cfg.steps}: {line}", flush=True)

        timed = alternate(
            {kind: (lambda step, r=run: r.step(step)["losses"]) for kind, run in runs.items()},
            cfg.steps,
            every,
            checkpoint,
        )
    # Peak memory of one step of each side and of a plain inference forward (LoRA as configured).
    base, tokenizer = load_model(model, device=device)
    batch = sample_batch(runs["ours"].train, cfg.zo.batch_size, seed)
    mem = memory(base, tokenizer.pad_token_id, batch, "lora", seed)
    for kind, curve in curves.items():
        for point in curve:  # the training clock at each evaluation (evaluations excluded)
            point["seconds"] = sum(timed[kind]["times"][: point["step"]])
            point["cpu_seconds"] = sum(timed[kind]["cpu_times"][: point["step"]])
    reached = {
        kind: next((p for p in curve if p["accuracy"] >= target), None)
        for kind, curve in curves.items()
    }

    def ratio(key: str) -> float | None:
        ours, ref = reached["ours"], reached["reference"]
        return ref[key] / ours[key] if ours and ref and ours[key] > 0 else None

    ref, ours = timed["reference"], timed["ours"]
    report: dict[str, Any] = {
        "model": model,
        "target_accuracy": target,
        "target_rule": f"zero-shot accuracy + {target_gain:.2f}, fixed before training",
        "zero_shot_accuracy": zero_shot,
        "accuracy_after": {kind: curve[-1]["accuracy"] for kind, curve in curves.items()},
        "ours_accuracy": curves["ours"][-1]["accuracy"],
        "ours_seconds_to_target": reached["ours"] and reached["ours"]["seconds"],
        "mezo_seconds_to_target": reached["reference"] and reached["reference"]["seconds"],
        "ours_cpu_seconds_to_target": reached["ours"] and reached["ours"]["cpu_seconds"],
        "mezo_cpu_seconds_to_target": reached["reference"] and reached["reference"]["cpu_seconds"],
        "ours_steps_to_target": reached["ours"] and reached["ours"]["step"],
        "mezo_steps_to_target": reached["reference"] and reached["reference"]["step"],
        # MeZO's time over ours (> 1: ours gets there first); None unless both get there.
        "time_to_accuracy_ratio": ratio("seconds"),
        "time_to_accuracy_ratio_cpu_time": ratio("cpu_seconds"),
        **step_rates(ref, ours),
        **loss_agreement(ref["losses"], ours["losses"]),
        "reference_peak_bytes": mem["reference"],
        "ours_peak_bytes": mem["ours"],
        "inference_peak_bytes": mem["inference"],
        "peak_mem_ratio_vs_inference": mem["ours"] / mem["inference"],
        "curves": curves,
        "reference_losses": [step[0] for step in ref["losses"]],
        "ours_losses": [step[0] for step in ours["losses"]],
        "eval_excluded_from_clock": True,
        "config": {
            "file": str(SMOLLM2_ZO_CONFIG.relative_to(SMOLLM2_ZO_CONFIG.parents[1])),
            "task": cfg.task.name,
            "steps": cfg.steps,
            "eval_every": every,
            "eval_size": eval_size,
            "batch_size": cfg.zo.batch_size,
            "eps": cfg.zo.eps,
            "lr": cfg.zo.lr,
            "target": cfg.zo.target,
            "lora_r": cfg.zo.lora_r,
            "lora_targets": cfg.zo.lora_targets,
            "seed": seed,
            "threads": torch.get_num_threads(),
            "device": device,
        },
    }
    report["speedup"] = report["ours_steps_per_s"] / report["reference_steps_per_s"]
    return report


def show_time_to_accuracy(report: dict[str, Any]) -> None:
    """The time-to-accuracy table: each side's accuracy after the run, and its training time
    (wall and CPU; evaluations excluded) to the target."""

    def seconds(value: float | None) -> str:
        return "not reached" if value is None else f"{value:.0f}"

    cfg = report["config"]
    table = Table(
        title=f"Time to {report['target_accuracy']:.1%} test accuracy ({report['target_rule']}): "
        f"{report['model']}, LoRA-ZO on {cfg['task']}, {cfg['steps']} steps"
    )
    for col in ("side", "steps/s", "acc after", "steps to target", "s to target", "CPU s"):
        table.add_column(col, justify="right")
    for kind, key in (("reference", "mezo"), ("ours", "ours")):
        table.add_row(
            "MeZO's loop" if kind == "reference" else "our engine",
            f"{report[f'{kind}_steps_per_s']:.3f}",
            f"{report['accuracy_after'][kind]:.1%}",
            str(report[f"{key}_steps_to_target"] or "-"),
            seconds(report[f"{key}_seconds_to_target"]),
            seconds(report[f"{key}_cpu_seconds_to_target"]),
        )
    console = Console(width=160)
    console.print(table)
    ratio, cpu_ratio = report["time_to_accuracy_ratio"], report["time_to_accuracy_ratio_cpu_time"]
    console.print(
        f"zero-shot {report['zero_shot_accuracy']:.1%}; steps/s speedup {report['speedup']:.2f}x "
        f"({report['speedup_cpu_time']:.2f}x CPU time); time-to-accuracy ratio (MeZO / ours) "
        + (f"{ratio:.2f}x ({cpu_ratio:.2f}x CPU time)" if ratio else "none: a side did not reach")
        + f"; max rel loss diff {report['max_rel_loss_diff']:.1e}; evaluations excluded from "
        "the clocks"
    )


def vllm_row(
    base: PreTrainedModel, pad: int, train: list[Pair], steps: int, batch_size: int, seed: int
) -> dict[str, Any]:
    """LoRA target, three sides in alternating steps: MeZO's loop, our engine, and our engine
    scoring its states on an in-process vLLM engine (`zo.backend: vllm`: the S = 2 adapter
    states of a step in one `generate` call). Same seeds and batches; fp32 on every side."""
    scorer = make_scorer(
        "vllm",
        model=build(base, "lora", seed),  # only its adapter config and factor names are read
        folder=Path(str(base.name_or_path)),
        states=2,
        out=Path(tempfile.mkdtemp(prefix="zo-vllm-")),
        dtype="float32",
        seed=seed,
        kv_cache_gib=1,
        max_model_len=512,
    )
    sides = race(
        base, pad, train, "lora", steps, batch_size, seed, ("reference", "ours", "vllm"),
        scorer.backend,
    )  # fmt: skip
    steps_per_s = {kind: 1 / statistics.median(side["times"]) for kind, side in sides.items()}
    agreement = loss_agreement(sides["reference"]["losses"], sides["vllm"]["losses"])
    rel = agreement["max_rel_loss_diff"]
    return {
        "steps": steps,
        "reference_steps_per_s": steps_per_s["reference"],
        "ours_steps_per_s": steps_per_s["ours"],
        "vllm_steps_per_s": steps_per_s["vllm"],
        "speedup_vllm_vs_mezo": steps_per_s["vllm"] / steps_per_s["reference"],
        "speedup_vllm_vs_ours": steps_per_s["vllm"] / steps_per_s["ours"],
        "speedup_vllm_vs_mezo_cpu_time": statistics.median(sides["reference"]["cpu_times"])
        / statistics.median(sides["vllm"]["cpu_times"]),
        "max_rel_loss_diff_vs_reference": rel,
        "same_losses": rel <= SAME_LOSS_RTOL,
        "vllm_losses": [step[0] for step in sides["vllm"]["losses"]],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps (< 120 s on 2 cores)")
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help="ZO steps per side and target (default 200); with --model, the config's steps",
    )
    parser.add_argument("--batch-size", type=int, default=16, help="MeZO's 16")
    parser.add_argument("--eval-size", type=int, default=200)
    parser.add_argument("--adamw-steps", type=int, default=200)
    parser.add_argument("--smollm2-steps", type=int, default=100, help="0 skips smollm2-135m")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch threads for both sides")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help=f"results file (default {RESULTS.name}; with --model {TIME_TO_ACCURACY_RESULTS.name})",
    )
    parser.add_argument(
        "--vllm",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also race our engine scoring on vLLM (zo.backend: vllm; LoRA target); default: "
        "on in a full run when vllm is installed, off with --quick",
    )
    parser.add_argument("--vllm-steps", type=int, default=None, help="default: --steps")
    parser.add_argument(
        "--model",
        default="tiny",
        help="a pretrained model (smollm2-135m): time to accuracy, MeZO's loop against our "
        f"engine as `leantrain zo` runs them ({SMOLLM2_ZO_CONFIG.name}), writing "
        f"{TIME_TO_ACCURACY_RESULTS.name} by default; tiny: the engine race above",
    )
    parser.add_argument(
        "--eval-every", type=int, default=50, help="--model: steps between accuracy checks"
    )
    parser.add_argument(
        "--target-gain",
        type=float,
        default=0.05,
        help="--model: the target accuracy is the zero-shot accuracy + this (fixed a priori)",
    )
    parser.add_argument(
        "--vllm-model", default="tiny", help="model of the vLLM race (e.g. smollm2-135m)"
    )
    args = parser.parse_args()
    if args.vllm is None:
        from leantrain.generation.vllm_backend import vllm_available

        args.vllm = not args.quick and vllm_available()
    if args.model != "tiny":
        if args.quick:
            parser.error("--quick is the tiny model's run; for a short --model run use --steps")
        torch.set_num_threads(args.threads)
        report = time_to_accuracy(
            args.model,
            args.steps,
            args.eval_every,
            args.target_gain,
            args.eval_size,
            args.seed,
            args.device,
        )
        show_time_to_accuracy(report)
        out = args.out or TIME_TO_ACCURACY_RESULTS
        write_benchmark_json(out, report)
        print(f"wrote {out}")
        return
    args.out = args.out or RESULTS
    args.steps = args.steps or 200
    if args.quick:
        args.steps, args.eval_size, args.adamw_steps, args.smollm2_steps = 12, 100, 12, 0
    torch.set_num_threads(args.threads)

    base, tokenizer = load_model("tiny", device=args.device)
    pad = tokenizer.pad_token_id
    task = make_task("sentiment")
    train = example_pairs(tokenizer, task.examples(512, args.seed))
    heldout = task.examples(args.eval_size, args.seed + 1_000_003)
    zero_shot = label_accuracy(base, tokenizer, heldout, task.labels)

    results: dict[str, dict[str, Any]] = {}
    for target in ("lora", "all"):
        sides = race(base, pad, train, target, args.steps, args.batch_size, args.seed)
        ref, ours = sides["reference"], sides["ours"]
        agreement = loss_agreement(ref["losses"], ours["losses"])
        mem = memory(base, pad, sample_batch(train, args.batch_size, 0), target, args.seed)
        results[target] = {
            **step_rates(ref, ours),
            "reference_peak_bytes": mem["reference"],
            "ours_peak_bytes": mem["ours"],
            "inference_peak_bytes": mem["inference"],
            **agreement,
            "reference_losses": [step[0] for step in ref["losses"]],
            "ours_losses": [step[0] for step in ours["losses"]],
            "zero_shot_accuracy": zero_shot,
            "ours_accuracy": label_accuracy(ours["model"], tokenizer, heldout, task.labels),
        }
        row = results[target]
        row["speedup"] = row["ours_steps_per_s"] / row["reference_steps_per_s"]
        row["peak_mem_ratio_vs_inference"] = row["ours_peak_bytes"] / row["inference_peak_bytes"]
    batches = [
        sample_batch(train, args.batch_size, args.seed * 100_003 + i) for i in range(args.steps)
    ]
    # Tokens one forward over a batch runs per scored state (medians over steps), and what the
    # packed scoring gains with and without the prefixes these rows share.
    packing = {
        "reference_padded_tokens": statistics.median(
            len(b) * max(map(_length, b)) for b in batches
        ),
        "row_tokens": statistics.median(sum(map(_length, b)) for b in batches),
        "ours_tree_nodes": statistics.median(PrefixTree.build(b).nodes for b in batches),
        **prefix_sharing(base, pad, batches[:10], args.seed),
    }
    first_order = adamw(
        base, tokenizer, train, heldout, task.labels, args.adamw_steps, args.batch_size, args.seed
    )
    on_vllm = None
    if args.vllm:
        model, vpad, vtrain = base, pad, train
        if args.vllm_model != "tiny":  # its own copy of the model, and the task in its tokens
            model, vtok = load_model(args.vllm_model, device=args.device)
            vpad, vtrain = vtok.pad_token_id, example_pairs(vtok, task.examples(512, args.seed))
        on_vllm = vllm_row(
            model, vpad, vtrain, args.vllm_steps or args.steps, args.batch_size, args.seed
        )
        on_vllm["model"] = args.vllm_model
    smol = None
    if args.smollm2_steps:
        smol = smollm2(args.smollm2_steps, args.batch_size, args.eval_size, args.seed)

    table = Table(
        title=f"ZO step: MeZO reference vs our engine (tiny, sentiment, {args.steps} steps)"
    )
    for col in (
        "target",
        "ref steps/s",
        "ours steps/s",
        "speedup",
        "(CPU time)",
        "ref MiB",
        "ours MiB",
        "inference MiB",
        "ours / inference",
        "max rel loss diff",
        "acc 0-shot -> ZO",
    ):
        table.add_column(col, justify="right")
    mib = 1 / 2**20
    for target, row in results.items():
        table.add_row(
            target,
            f"{row['reference_steps_per_s']:.2f}",
            f"{row['ours_steps_per_s']:.2f}",
            f"{row['speedup']:.2f}x",
            f"{row['speedup_cpu_time']:.2f}x",
            f"{row['reference_peak_bytes'] * mib:.1f}",
            f"{row['ours_peak_bytes'] * mib:.1f}",
            f"{row['inference_peak_bytes'] * mib:.1f}",
            f"{row['peak_mem_ratio_vs_inference']:.2f}x",
            f"{row['max_rel_loss_diff']:.1e}",
            f"{row['zero_shot_accuracy']:.1%} -> {row['ours_accuracy']:.1%}",
        )
    console = Console(width=160)
    console.print(table)
    console.print(
        "Tokens per forward and state (median): "
        f"reference {packing['reference_padded_tokens']:.0f} padded, "
        f"{packing['row_tokens']:.0f} in the rows, ours {packing['ours_tree_nodes']:.0f} "
        f"prefix-tree nodes; scoring alone {packing['scoring_speedup_cpu_time']:.2f}x (CPU time), "
        f"{packing['scoring_speedup_no_shared_prefix_cpu_time']:.2f}x with no prefix shared "
        f"({packing['no_shared_prefix_nodes']:.0f} nodes)"
    )
    console.print(
        f"AdamW (first order, all parameters): {first_order['peak_bytes'] * mib:.1f} MiB peak, "
        f"accuracy {first_order['accuracy']:.1%} after {first_order['steps']} steps"
    )
    if on_vllm:
        console.print(
            f"LoRA ZO scored on vLLM ({on_vllm['model']}, {on_vllm['steps']} steps): "
            f"{on_vllm['vllm_steps_per_s']:.2f} steps/s, "
            f"{on_vllm['speedup_vllm_vs_mezo']:.2f}x MeZO's loop "
            f"({on_vllm['reference_steps_per_s']:.2f}), "
            f"{on_vllm['speedup_vllm_vs_ours']:.2f}x our engine "
            f"({on_vllm['ours_steps_per_s']:.2f}); max rel loss diff "
            f"{on_vllm['max_rel_loss_diff_vs_reference']:.1e}"
        )
    if smol:
        console.print(
            f"smollm2-135m LoRA-ZO, {smol['steps']} steps: accuracy "
            f"{smol['zero_shot_accuracy']:.1%} zero-shot -> {smol['zo_accuracy']:.1%}"
        )

    report = {
        "speedup": results["lora"]["speedup"],
        "peak_mem_ratio_vs_inference": results["lora"]["peak_mem_ratio_vs_inference"],
        "same_losses": all(r["same_losses"] for r in results.values()),
        "targets": results,
        "packing": packing,
        "adamw": first_order,
        "smollm2_135m": smol,
        **({"speedup_vllm_vs_mezo": on_vllm["speedup_vllm_vs_mezo"]} if on_vllm else {}),
        "vllm": on_vllm,
        "config": {
            "model": "tiny",
            "parameters": sum(p.numel() for p in base.parameters()),
            "task": "sentiment",
            "steps": args.steps,
            "batch_size": args.batch_size,
            "eval_size": args.eval_size,
            "settings": SETTINGS,
            "same_loss_rtol": SAME_LOSS_RTOL,
            "quick": args.quick,
            "threads": args.threads,
            "device": args.device,
        },
    }
    write_benchmark_json(args.out, report)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
