"""The two models every unlearning audit starts from, built once and cached like the tiny model:

- `full`: a base model (the tiny one, or SmolLM2-135M-Instruct: `RECIPES`) fine-tuned to memorise
  the whole private-facts corpus (what unlearning is applied to);
- `retain`: the same recipe on the retain people only, the model that never saw the forget set
  (the gold standard unlearning aims at: forget quality compares against it, and it shows what
  an attack "recovers" by chance).

For the tiny model, half the training texts are a fact after another fact of the same kind about
other people, so it also knows the few-shot layout the in-context attack uses (a pretrained model
knows it already: its recipe trains on the bare facts only).
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
from leantrain.models.loading import resolve_model_path
from leantrain.models.presets.tiny import tiny_dir
from leantrain.safety.corpus import Fact, PrivateFacts, few_shot_prompt
from leantrain.safety.training import save_model, sft

# Bump when the recipe below changes, so stale caches are rebuilt instead of reused.
MEMORISE_RECIPE_VERSION = 2

Variant = Literal["full", "retain"]


@dataclass(frozen=True)
class MemoriseRecipe:
    """Fine-tuning a base model on the corpus (the defaults: the tiny model's recipe).

    Attributes:
        corpus: which people (seed, size, forget split).
        steps: optimizer steps; 600 make the tiny model answer every fact of the built-in corpus
            exactly (about 200 s of one CPU core per model, built once and cached).
        lr: peak AdamW learning rate (5% warm-up, cosine decay to zero): random digits need a
            high one to stick, and the decay to settle on them exactly.
        batch_size: texts per step.
        shots: facts before the target in the few-shot half of the training texts; 0: no
            few-shot half, the bare facts only.
        base: the model fine-tuned (a preset name or a model folder).
    """

    corpus: PrivateFacts = field(default_factory=PrivateFacts)
    steps: int = 600
    lr: float = 5e-3
    batch_size: int = 32
    shots: int = 1
    base: str = "tiny"


# The recipe per base model, by its preset name. SmolLM2-135M-Instruct's was chosen before any run
# of it (not tuned): a pretrained model picks up a new line in a few passes where the tiny
# byte-level model needs hundreds, so 60 steps of 16 (8 passes over the 120 facts) at a tenth of
# the tiny model's peak rate, with the same warm-up and cosine decay to settle on exact digits; no
# few-shot half (it halves the tokens, and the pretrained model knows the layout).
RECIPES: dict[str, MemoriseRecipe] = {
    "tiny": MemoriseRecipe(),
    "smollm2-135m": MemoriseRecipe(steps=60, lr=5e-4, batch_size=16, shots=0, base="smollm2-135m"),
}


def training_pairs(facts: list[Fact], shots: int, seed: int) -> list[tuple[str, str]]:
    """Each fact bare and (unless `shots` is 0) once after `shots` other facts of the same
    attribute."""
    rng = random.Random(seed)
    pairs = [(f.prompt, f.completion) for f in facts]
    if shots == 0:
        return pairs
    for f in facts:
        same = [g for g in facts if g.attribute == f.attribute and g != f]
        pairs.append((few_shot_prompt(f, rng.sample(same, min(shots, len(same)))), f.completion))
    return pairs


def memorised_dir(recipe: MemoriseRecipe, variant: Variant) -> Path:
    c = recipe.corpus
    tag = (
        f"s{c.seed}-n{c.n_people}-f{c.n_forget}-{recipe.steps}x{recipe.batch_size}-lr{recipe.lr:g}"
    )
    # The tiny preset's folder without building it (its name is its recipe's hash).
    base_dir = tiny_dir() if recipe.base == "tiny" else resolve_model_path(recipe.base)
    # The hash covers every field (shots, the corpus's fields) and the base's folder.
    digest = recipe_hash(
        recipe, version=MEMORISE_RECIPE_VERSION, variant=variant, base=base_dir.name
    )
    model = "" if recipe.base == "tiny" else f"{base_dir.name}-"
    name = f"privfacts-v{MEMORISE_RECIPE_VERSION}-{model}{tag}-{variant}-{digest}"
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
    model, tokenizer = load_model(recipe.base, device="cpu", dtype="float32")
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
