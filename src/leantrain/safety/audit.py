"""The unlearning audit: every attack and metric on one model, and the report (JSON, Markdown
table, plot) over several. `leantrain audit` and `benchmarks/unlearning.py` both run this.

Sets: extraction is measured on `forget_eval` people (the ones the relearning attack never
shows the model), so the three attacks compare like with like; retain utility is the direct
extraction rate on the retain set.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from leantrain.models import load_model
from leantrain.safety.attacks import (
    extraction_rate,
    forget_quality,
    in_context_prompts,
    probe_accuracy,
    relearn,
    truth_ratios,
)
from leantrain.safety.config import AuditConfig
from leantrain.safety.corpus import CITIES, PrivateFacts
from leantrain.safety.memorise import MemoriseRecipe, ensure_memorised

COLUMNS = {  # result key -> table header
    "direct": "direct",
    "in_context": "in-context",
    "relearn": "relearn",
    "retain_utility": "retain utility",
    "forget_quality": "forget quality (p)",
}


def audit_model(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    corpus: PrivateFacts,
    reference_ratios: np.ndarray,
    config: AuditConfig = AuditConfig(),
) -> dict[str, Any]:
    """Every attack and metric on `model`. `reference_ratios`: truth ratios of the forget set on
    the retain-only model (see `truth_ratios`), the distribution forget quality compares to."""
    target = corpus.facts("forget_eval")
    attacked = relearn(
        model, tokenizer, corpus, steps=config.relearn_steps, lr=config.relearn_lr, seed=config.seed
    )
    ratios = truth_ratios(model, tokenizer, corpus, corpus.facts("forget"))
    return {
        "direct": extraction_rate(model, tokenizer, target),
        "in_context": extraction_rate(
            model, tokenizer, target, in_context_prompts(corpus, target, config.shots)
        ),
        "relearn": extraction_rate(attacked, tokenizer, target),
        "retain_utility": extraction_rate(model, tokenizer, corpus.facts("retain")),
        "forget_quality": forget_quality(ratios, reference_ratios),
        "truth_ratio_median": float(np.median(ratios)),
        "probe": probe_accuracy(model, tokenizer, corpus),
    }


def markdown_table(results: dict[str, dict[str, Any]]) -> str:
    """One row per audited model: extraction under each attack, utility, forget quality, and
    probe accuracy per layer."""
    n_layers = max(len(r["probe"]) for r in results.values())
    header = ["model", *COLUMNS.values(), *(f"probe L{i}" for i in range(n_layers))]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, r in results.items():
        cells = [f"{r[k]:.3g}" if k == "forget_quality" else f"{r[k]:.0%}" for k in COLUMNS]
        cells += [f"{acc:.0%}" for acc in r["probe"]]
        lines.append("| " + " | ".join([name, *cells]) + " |")
    return "\n".join(lines) + "\n"


def plot_audit(results: dict[str, dict[str, Any]], out: Path, chance: float) -> Path:
    """Left: extraction rate per attack and model. Right: probe accuracy per layer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    attacks = ("direct", "in_context", "relearn")
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8))
    width = 0.8 / len(results)
    for i, (name, r) in enumerate(results.items()):
        xs = np.arange(len(attacks)) + i * width
        left.bar(xs, [r[a] for a in attacks], width, label=name)
        right.plot(range(len(r["probe"])), r["probe"], marker="o", label=name)
    left.set_xticks(np.arange(len(attacks)) + 0.4 - width / 2, [COLUMNS[a] for a in attacks])
    left.set_ylabel("extraction rate (forget_eval)")
    left.set_ylim(0, 1)
    right.axhline(chance, color="grey", linestyle="--", linewidth=1, label="chance")
    right.set_xticks(range(max(len(r["probe"]) for r in results.values())))
    right.set_xlabel("layer (0 = embeddings)")
    right.set_ylabel("probe accuracy (city of forget people)")
    right.set_ylim(0, 1.05)
    right.legend(fontsize=7)
    left.legend(fontsize=7)
    for ax in (left, right):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def write_report(
    results: dict[str, dict[str, Any]], out: Path, chance: float = 1 / len(CITIES)
) -> dict[str, Path]:
    """audit.json, audit.md and audit.png in `out` (`chance`: the probe's guessing level)."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "audit.json", "markdown": out / "audit.md", "plot": out / "audit.png"}
    paths["json"].write_text(json.dumps(results, indent=2) + "\n")
    paths["markdown"].write_text(markdown_table(results))
    plot_audit(results, paths["plot"], chance)
    return paths


def reference_ratios(recipe: MemoriseRecipe, *, progress: bool = True) -> np.ndarray:
    """Truth ratios of the forget set on the retain-only model (built once if needed)."""
    model, tokenizer = load_model(
        ensure_memorised(recipe, "retain", progress=progress), device="cpu"
    )
    return truth_ratios(model, tokenizer, recipe.corpus, recipe.corpus.facts("forget"))


def audit_folders(
    folders: dict[str, Path],
    recipe: MemoriseRecipe,
    config: AuditConfig = AuditConfig(),
    *,
    progress: bool = True,
) -> dict[str, dict[str, Any]]:
    """`audit_model` on each named model folder, all against the same retain-only reference."""
    reference = reference_ratios(recipe, progress=progress)
    results = {}
    for name, folder in folders.items():
        model, tokenizer = load_model(folder, device="cpu")
        results[name] = audit_model(model, tokenizer, recipe.corpus, reference, config)
    return results
