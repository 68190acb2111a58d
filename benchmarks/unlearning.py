"""Unlearning audit: every unlearning method against every attack on the tiny model that memorised
the built-in private-facts corpus (PrivUn, arXiv 2604.22076, at our scale), or on SmolLM2-135M-
Instruct that memorised it (`--model smollm2-135m`).

Rows: the memorised model (nothing unlearned), GA, GradDiff, NPO, RMU (one layer), RMU with
multi-layer representation constraints (PrivUn's mitigation), and the retain-only model that never
saw the forget set (what "forgotten" should look like). Each method runs with its tuned steps,
learning rate and retain weight (`leantrain.safety.config.TUNED`). Columns: extraction rate on
`forget_eval` people by direct query, in-context recovery and relearning (fine-tuning on the
*other* forget people), retain utility, forget quality (KS p-value), and linear-probe accuracy at
the deepest layer.

The finding to check: recovery after relearning against extraction right after unlearning. The
retain-only row is the control: relearning on `forget_attack` cannot teach it `forget_eval`'s
random phone numbers, so what relearning brings back above that row was never removed.

    python benchmarks/unlearning.py            # median over 3 unlearning seeds
    python benchmarks/unlearning.py --quick    # one seed: under 180 s on 2 idle cores
    python benchmarks/unlearning.py --model smollm2-135m --out /tmp/unlearning_smollm2.json
    python benchmarks/real_model.py unlearning  # the same, to results/unlearning_smollm2.json

On smollm2 the same code runs with that
model's memorising recipe (`RECIPES`), unlearning settings (`TUNED_BY_MODEL`) and attack strength
(`AUDIT_BY_MODEL`), one seed and, by default, NPO and multi-layer RMU only (`DEFAULT_METHODS`): a
135M model's step costs about 150 times the tiny one's, and all five methods at three seeds would
take hours on 2 cores.

The memorised and retain-only models are built once and cached (like the tiny model); a first run
also pays for that build, and says how long it took.

Writes benchmarks/results/unlearning.json: `extraction_after_unlearn`, `extraction_after_relearn`,
`probe_acc_deep_layer` (each per method), `model`, and the full table under `results`.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch
import transformers
from rich.console import Console
from rich.table import Table

from leantrain.models import load_model
from leantrain.safety.attacks import extraction_rate, truth_ratios
from leantrain.safety.audit import audit_model, write_report
from leantrain.safety.config import (
    AUDIT_BY_MODEL,
    METHODS,
    TUNED_BY_MODEL,
    AuditConfig,
    UnlearnConfig,
)
from leantrain.safety.corpus import PrivateFacts
from leantrain.safety.memorise import RECIPES, ensure_memorised
from leantrain.safety.unlearn import unlearn
from leantrain.telemetry.report import write_benchmark_json

RESULTS = Path(__file__).parent / "results" / "unlearning.json"
# hidden_states index of the probe column: the last block's output (after the final norm), the
# one layer where the memorised model's city probe is far above chance (88% against 12.5%; at
# hidden_states[-2] it is 38%). Shallower states do not yet hold the answer's first byte.
DEEP_LAYER = -1
# Methods run when --methods is not given: all five on the tiny model; on smollm2 the baseline
# PrivUn reports as most robust among the loss-based ones (NPO) and its mitigation (multi-layer
# RMU), the two rows its finding is about, which fit in the time one area's run has.
DEFAULT_METHODS = {"tiny": METHODS, "smollm2-135m": ("npo", "rmu_multilayer")}
SEEDS = {"tiny": 3, "smollm2-135m": 1}


def median_of(runs: list[dict]) -> dict:
    """Median over unlearning seeds of every figure (of each layer's probe accuracy too)."""
    return {
        key: np.median([r[key] for r in runs], axis=0).tolist()
        if key == "probe"
        else float(np.median([r[key] for r in runs]))
        for key in runs[0]
    }


def select_lr(
    full_dir: Path, corpus: PrivateFacts, methods: list[str], tuned: dict, rates: list[float]
) -> None:
    """Each method at each learning rate (its tuned steps and retain weight): direct extraction
    on the `forget_attack` people and retain utility, printed. Training data only (unlearning
    reads the whole forget set; the audit reports `forget_eval`, never read here): how a new
    model's rates are picked without looking at the test split."""
    for name in methods:
        for lr in rates:
            t0 = time.perf_counter()
            model, tokenizer = load_model(full_dir, device="cpu")
            cfg = UnlearnConfig(**{**tuned[name], "method": name, "lr": lr})
            unlearn(model, tokenizer, corpus, cfg, progress=False)
            attack = extraction_rate(model, tokenizer, corpus.facts("forget_attack"))
            retain = extraction_rate(model, tokenizer, corpus.facts("retain"))
            print(
                f"{name} lr={lr:g}: forget_attack direct {attack:.0%}, retain utility {retain:.0%}"
                f" ({time.perf_counter() - t0:.0f} s)",
                flush=True,
            )


def print_row(name: str, r: dict, seconds: float | None) -> None:
    """One row's figures as soon as they are measured (a long run's log keeps what it got)."""
    figures = ", ".join(
        f"{k} {r[k]:.0%}" for k in ("direct", "in_context", "relearn", "retain_utility")
    )
    print(
        f"{name}: {figures}, forget quality {r['forget_quality']:.2g}, "
        f"probe {r['probe'][DEEP_LAYER]:.0%}, {seconds} s",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="one unlearning seed instead of --seeds"
    )
    parser.add_argument(
        "--model", choices=list(RECIPES), default="tiny", help="the base model that memorises"
    )
    parser.add_argument(
        "--seeds",
        type=int,
        default=None,
        help="unlearning seeds, median reported (tiny: 3, smollm2: 1)",
    )
    parser.add_argument(
        "--methods", nargs="+", default=None, choices=METHODS, help="default: DEFAULT_METHODS"
    )
    parser.add_argument("--relearn-steps", type=int, default=None, help="relearning attack steps")
    parser.add_argument("--relearn-lr", type=float, default=None, help="relearning attack lr")
    parser.add_argument(
        "--select-lr",
        nargs="+",
        type=float,
        default=None,
        help="only pick learning rates: unlearn at each, print forget_attack extraction and "
        "retain utility (training data only; no audit, forget_eval never read)",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--report", type=Path, default=None, help="also write audit.md/png here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    transformers.utils.logging.disable_progress_bar()  # ours is the only bar on screen
    start = time.perf_counter()

    recipe = RECIPES[args.model]
    methods = args.methods or list(DEFAULT_METHODS[args.model])
    tuned = TUNED_BY_MODEL[args.model]
    build_start = time.perf_counter()
    full_dir = ensure_memorised(recipe, "full")
    retain_dir = ensure_memorised(recipe, "retain")
    build_s = time.perf_counter() - build_start
    corpus = recipe.corpus
    if args.select_lr:
        select_lr(full_dir, corpus, methods, tuned, args.select_lr)
        return
    audit_cfg = AuditConfig(**AUDIT_BY_MODEL[args.model])
    if args.relearn_steps is not None:
        audit_cfg = audit_cfg.model_copy(update={"relearn_steps": args.relearn_steps})
    if args.relearn_lr is not None:
        audit_cfg = audit_cfg.model_copy(update={"relearn_lr": args.relearn_lr})

    retain_model, tokenizer = load_model(retain_dir, device="cpu")
    reference = truth_ratios(retain_model, tokenizer, corpus, corpus.facts("forget"))
    results, seconds = {}, {}
    seeds = range(1 if args.quick else args.seeds or SEEDS[args.model])
    with Console().status("") as status:
        for name in ["memorised", *methods]:
            t0 = time.perf_counter()
            runs = []
            for seed in seeds if name != "memorised" else [0]:
                status.update(f"{name} (seed {seed}): unlearning and attacking")
                model, tokenizer = load_model(full_dir, device="cpu")
                if name != "memorised":
                    cfg = UnlearnConfig(method=name, seed=seed, **tuned[name])
                    unlearn(model, tokenizer, corpus, cfg, progress=False)
                runs.append(audit_model(model, tokenizer, corpus, reference, audit_cfg))
            results[name] = median_of(runs)
            seconds[name] = round(time.perf_counter() - t0, 1)
            print_row(name, results[name], seconds[name])
        status.update("retain-only control")
        results["retain-only"] = audit_model(retain_model, tokenizer, corpus, reference, audit_cfg)
        print_row("retain-only", results["retain-only"], None)

    memorised = results["memorised"]["direct"]
    table = Table(title=f"unlearning audit: extraction rate on forget_eval people ({args.model})")
    for col in ("model", "direct", "in-ctx", "relearn", "recov.", "retain", "FQ p", "probe", "s"):
        table.add_column(col, justify="right")
    for name, r in results.items():
        recovered = r["relearn"] / memorised if memorised else float("nan")
        table.add_row(
            name,
            *(f"{r[k]:.0%}" for k in ("direct", "in_context", "relearn")),
            f"{recovered:.0%}",
            f"{r['retain_utility']:.0%}",
            f"{r['forget_quality']:.2g}",
            f"{r['probe'][DEEP_LAYER]:.0%}",
            str(seconds.get(name, "")),
        )
    console = Console(width=120)
    console.print(table)
    console.print(
        "in-ctx: in-context attack; recov.: relearn extraction / the memorised model's direct "
        "extraction; retain: retain-set extraction (utility); FQ p: forget quality (KS p-value); "
        f"probe: city probe accuracy at hidden_states[{DEEP_LAYER}] (chance 1/8); s: seconds"
    )
    if args.report:
        write_report(results, args.report)

    report = {
        "model": args.model,
        "extraction_after_unlearn": {n: results[n]["direct"] for n in methods},
        "extraction_after_relearn": {n: results[n]["relearn"] for n in methods},
        "probe_acc_deep_layer": {n: results[n]["probe"][DEEP_LAYER] for n in methods},
        "results": results,
        "config": {
            "recipe": {
                "steps": recipe.steps,
                "lr": recipe.lr,
                "batch_size": recipe.batch_size,
                "shots": recipe.shots,
                "corpus": corpus.__dict__,
            },
            "unlearn": {m: UnlearnConfig(method=m, **tuned[m]).model_dump() for m in methods},
            "audit": audit_cfg.model_dump(),
            "quick": args.quick,
            "seeds": len(seeds),
            "threads": args.threads,
            "deep_layer": DEEP_LAYER,
            "seconds_unlearn_and_attack": seconds,
            "seconds_model_build": round(build_s, 1),
            "seconds_total": round(time.perf_counter() - start, 1),
        },
    }
    write_benchmark_json(args.out, report)
    print(f"wrote {args.out} in {report['config']['seconds_total']} s")


if __name__ == "__main__":
    main()
