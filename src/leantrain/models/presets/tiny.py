"""The embedded default model: a ~1 M-parameter Llama warm-started by supervised training on the
built-in tasks' worked solutions until it solves some but not most `arith` problems, then cached
as an ordinary Hugging Face folder (safetensors) so every later load takes milliseconds. The
default recipe's build ships with the package (models/build_cache.py), so a first use copies it.

Knows nothing about RL: it only needs problems with worked solutions (`Task.sample().solution`).
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import LlamaForCausalLM, PreTrainedTokenizerBase

from leantrain.models.build_cache import SHIPPED_BUILDS, build_once, recipe_hash
from leantrain.models.finetune import backward_token_mean, completion_chunks
from leantrain.models.tiny_config import tiny_config
from leantrain.models.tokenizer import build_byte_tokenizer
from leantrain.settings import leantrain_home
from leantrain.tasks import ArithTask, Task
from leantrain.training.sft import SFTLoop

# Bump when the recipe below changes, so stale caches are rebuilt instead of reused.
TINY_RECIPE_VERSION = 5


@dataclass(frozen=True)
class WarmStartRecipe:
    """Supervised warm start of the tiny model.

    Attributes:
        seed: fixes initialization and data; the same seed builds the same weights.
        steps: optimizer steps; 81 s at the build's one thread (59 s at two).
        batch_size: sequences per step.
        chunks: forward passes per step (sequences of similar length padded together).
        lr: peak AdamW learning rate (cosine decay to 10% after a short warm-up).
        max_items: longest `arith` list seen in training; longer lists stay unseen, which keeps the
            model from solving most problems and leaves RL something to learn.
    """

    seed: int = 0
    steps: int = 280
    batch_size: int = 32
    chunks: int = 4
    lr: float = 3e-3
    max_items: int = 12


def tiny_dir(recipe: WarmStartRecipe = WarmStartRecipe()) -> Path:
    """The cache folder of `recipe`'s build: version and seed to read, the recipe's hash to tell
    builds apart."""
    tag = recipe_hash(recipe, version=TINY_RECIPE_VERSION)
    return leantrain_home() / "models" / f"tiny-v{TINY_RECIPE_VERSION}-seed{recipe.seed}-{tag}"


def ensure_tiny(
    recipe: WarmStartRecipe = WarmStartRecipe(), *, progress: bool = True, rebuild: bool = False
) -> Path:
    """Return the cached tiny model folder, first copied from the shipped build of `recipe` or
    built (one builder at a time); `rebuild` builds it from the recipe again."""
    target = tiny_dir(recipe)
    return build_once(
        target,
        lambda staging: build_tiny(staging, recipe, progress=progress),
        shipped=SHIPPED_BUILDS / target.name,
        rebuild=rebuild,
    )


def _sft_chunks(
    task: Task, tokenizer: PreTrainedTokenizerBase, rng: random.Random, batch_size: int, chunks: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`batch_size` problems with their worked solutions, as `chunks` padded (ids, labels)."""
    pairs = []
    for _ in range(batch_size):
        ex = task.sample(rng)
        pairs.append(
            (tokenizer.encode(ex.prompt), [*tokenizer.encode(ex.solution), tokenizer.eos_token_id])
        )
    return completion_chunks(pairs, tokenizer.pad_token_id, chunks)


def build_tiny(out: Path, recipe: WarmStartRecipe, *, progress: bool = True) -> dict:
    """Train the tiny model from scratch on worked solutions and save it to `out`."""
    start = time.perf_counter()
    torch.manual_seed(recipe.seed)
    tokenizer = build_byte_tokenizer()
    model = LlamaForCausalLM(tiny_config(tokenizer))
    task = ArithTask(max_items=recipe.max_items)
    rng = random.Random(recipe.seed)
    warmup = max(1, recipe.steps // 20)

    def lr_at(step: int) -> float:
        """Linear warm-up, then cosine decay to 10% of the peak (as a fraction of it)."""
        if step < warmup:
            return (step + 1) / warmup
        frac = (step - warmup) / max(1, recipe.steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac))

    loop = SFTLoop(model, lambda step: recipe.lr * lr_at(step), weight_decay=0.01)
    history = loop.run(
        lambda: backward_token_mean(
            model, _sft_chunks(task, tokenizer, rng, recipe.batch_size, recipe.chunks)
        ),
        recipe.steps,
        label="building the tiny model (one-off)",
        progress=progress,
    )
    loss_sum = history[-1].loss
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    info = {
        "recipe": asdict(recipe),
        "recipe_version": TINY_RECIPE_VERSION,
        "final_loss": round(loss_sum, 4),
        "train_seconds": round(time.perf_counter() - start, 1),
        "parameters": sum(p.numel() for p in model.parameters()),
    }
    (out / "build.json").write_text(json.dumps(info, indent=2))
    return info
