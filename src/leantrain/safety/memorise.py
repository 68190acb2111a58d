"""The two models every unlearning audit starts from, built once and cached like the tiny model:

- `full`: the tiny model fine-tuned to memorise the whole private-facts corpus (what unlearning
  is applied to);
- `retain`: the same recipe on the retain people only, the model that never saw the forget set
  (the gold standard unlearning aims at: forget quality compares against it, and it shows what
  an attack "recovers" by chance).

Half the training texts are a fact after another fact of the same kind about other people, so the
models also know the few-shot layout the in-context attack uses.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import torch

from leantrain.errors import LeantrainError
from leantrain.models import leantrain_home, load_model
from leantrain.models.build_cache import build_once, recipe_hash
from leantrain.models.presets.tiny import tiny_dir
from leantrain.safety.corpus import Fact, PrivateFacts, few_shot_prompt
from leantrain.safety.training import save_model, sft

# Bump when the recipe below changes, so stale caches are rebuilt instead of reused.
MEMORISE_RECIPE_VERSION = 2

Variant = Literal["full", "retain"]


@dataclass(frozen=True)
class MemoriseRecipe:
    """Fine-tuning the tiny model on the corpus.

    Attributes:
        corpus: which people (seed, size, forget split).
        steps: optimizer steps; 600 make the tiny model answer every fact of the built-in corpus
            exactly (about 200 s of one CPU core per model, built once and cached).
        lr: peak AdamW learning rate (5% warm-up, cosine decay to zero): random digits need a
            high one to stick, and the decay to settle on them exactly.
        batch_size: texts per step.
        shots: facts before the target in the few-shot half of the training texts.
    """

    corpus: PrivateFacts = field(default_factory=PrivateFacts)
    steps: int = 600
    lr: float = 5e-3
    batch_size: int = 32
    shots: int = 1


def training_pairs(facts: list[Fact], shots: int, seed: int) -> list[tuple[str, str]]:
    """Each fact bare and once after `shots` other facts of the same attribute."""
    rng = random.Random(seed)
    pairs = [(f.prompt, f.completion) for f in facts]
    for f in facts:
        same = [g for g in facts if g.attribute == f.attribute and g != f]
        pairs.append((few_shot_prompt(f, rng.sample(same, min(shots, len(same)))), f.completion))
    return pairs


def memorised_dir(recipe: MemoriseRecipe, variant: Variant) -> Path:
    c = recipe.corpus
    tag = (
        f"s{c.seed}-n{c.n_people}-f{c.n_forget}-{recipe.steps}x{recipe.batch_size}-lr{recipe.lr:g}"
    )
    # The hash covers every field (shots, the corpus's fields) and the tiny base's folder.
    digest = recipe_hash(
        recipe, version=MEMORISE_RECIPE_VERSION, variant=variant, base=tiny_dir().name
    )
    name = f"privfacts-v{MEMORISE_RECIPE_VERSION}-{tag}-{variant}-{digest}"
    return leantrain_home() / "models" / name


def ensure_memorised(
    recipe: MemoriseRecipe = MemoriseRecipe(), variant: Variant = "full", *, progress: bool = True
) -> Path:
    """The cached model folder for `variant`, built first if needed (one builder at a time)."""
    return build_once(
        memorised_dir(recipe, variant),
        lambda staging: _build(staging, recipe, variant, progress),
        marker="memorise.json",
    )


def _build(out: Path, recipe: MemoriseRecipe, variant: Variant, progress: bool) -> None:
    torch.manual_seed(recipe.corpus.seed)
    model, tokenizer = load_model("tiny", device="cpu", dtype="float32")
    facts = recipe.corpus.facts("retain")
    if variant == "full":
        facts = recipe.corpus.facts("forget") + facts
    losses = sft(
        model,
        tokenizer,
        training_pairs(facts, recipe.shots, recipe.corpus.seed),
        steps=recipe.steps,
        lr=recipe.lr,
        batch_size=recipe.batch_size,
        seed=recipe.corpus.seed,
        schedule="cosine",
        label=f"memorising the private-facts corpus ({variant}, one-off)",
        progress=progress,
    )
    save_model(model, tokenizer, out)
    info = {
        "recipe": asdict(recipe),
        "variant": variant,
        "final_loss": round(losses[-1], 4),
        "version": MEMORISE_RECIPE_VERSION,
    }
    (out / "memorise.json").write_text(json.dumps(info, indent=2))


def recipe_of(model_dir: Path) -> MemoriseRecipe:
    """The recipe a model folder descends from: read from its memorise.json (a memorised model)
    or unlearn.json (an unlearned one)."""
    for name in ("unlearn.json", "memorise.json"):
        path = Path(model_dir) / name
        if path.is_file():
            data = json.loads(path.read_text())["recipe"]
            return MemoriseRecipe(**{**data, "corpus": PrivateFacts(**data["corpus"])})
    raise LeantrainError(
        f"{model_dir} has neither unlearn.json nor memorise.json: audit a folder written by "
        "`leantrain unlearn` (or a memorised model)"
    )
