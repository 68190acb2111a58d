"""The `tiny-tools` preset: the tiny model warm-started on worked `tool_arith` episodes, so that
multi-turn GRPO (`configs/tiny-tools.yaml`) starts from a policy that calls the tool and sometimes
copies its output into the answer, and has the rest left to learn.

The built-in `tiny` model only knows `arith`; it never writes `<python>`, so every tool reward is
0 and GRPO has no signal. This recipe fine-tunes it on solved episodes laid out exactly as the
episode runner builds them (prompt, model turn, environment reply, model turn), with the loss on
the model's turns only: each model turn is one training row whose context is everything before it,
the environment's reply included, as in RL where environment tokens are read but never trained on.
Training stops early on purpose (like `tiny`'s arith warm start) so held-out accuracy is partial.

Built on first use, cached under `$LEANTRAIN_HOME/models/` as a Hugging Face folder (one builder at
a time, through a staging folder). Knows nothing about RL: it imports `tasks`, never `rl`.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import AutoTokenizer, LlamaForCausalLM, PreTrainedTokenizerBase

from leantrain.models.build_cache import SHIPPED_BUILDS, build_once, recipe_hash
from leantrain.models.finetune import backward_token_mean, completion_chunks
from leantrain.models.presets.tiny import ensure_tiny, tiny_dir
from leantrain.settings import leantrain_home
from leantrain.tasks.tool_arith import ToolArithTask, worked_turns
from leantrain.training.sft import SFTLoop

# Bump when the recipe below changes, so stale caches are rebuilt instead of reused.
TINY_TOOLS_RECIPE_VERSION = 1


@dataclass(frozen=True)
class ToolWarmStartRecipe:
    """Supervised warm start of `tiny-tools` from the `tiny` model.

    Attributes:
        seed: fixes the data; the same seed builds the same weights.
        steps: optimizer steps; few enough that the answer comes out right only part of the
            time (44 of 64 held-out episodes, greedy, on the deterministic build), which leaves
            GRPO something to learn. 94 s to build at the build's one thread.
        batch_size: episodes per step (each gives one row per model turn).
        chunks: forward passes per step (rows of similar length padded together).
        lr: constant AdamW learning rate.
        max_digits: most digits of a number; `configs/tiny-tools.yaml` uses the same task.
        max_terms: numbers per expression (2..max_terms).
        copy_drill: share of episodes whose tool output (and so the answer) is a random number
            instead of the expression's value: the answer then can only come from copying the
            output, which a byte-level model otherwise learns slowly because it can also try to
            compute the answer from the expression.
    """

    seed: int = 0
    steps: int = 200
    batch_size: int = 32
    chunks: int = 2
    lr: float = 3e-3
    max_digits: int = 2
    max_terms: int = 2
    copy_drill: float = 0.5

    def task(self) -> ToolArithTask:
        """The `tool_arith` task the recipe trains on."""
        return ToolArithTask(min_digits=1, max_digits=self.max_digits, max_terms=self.max_terms)


def tiny_tools_dir(recipe: ToolWarmStartRecipe = ToolWarmStartRecipe()) -> Path:
    """The cache folder of `recipe`'s build on the default `tiny` base (its folder is hashed in:
    a rebuilt base gives a rebuilt `tiny-tools`)."""
    tag = recipe_hash(recipe, version=TINY_TOOLS_RECIPE_VERSION, base=tiny_dir().name)
    name = f"tiny-tools-v{TINY_TOOLS_RECIPE_VERSION}-seed{recipe.seed}-{tag}"
    return leantrain_home() / "models" / name


def ensure_tiny_tools(
    recipe: ToolWarmStartRecipe = ToolWarmStartRecipe(),
    *,
    progress: bool = True,
    rebuild: bool = False,
) -> Path:
    """Return the cached `tiny-tools` folder, first copied from the shipped build of `recipe` or
    built on the cached `tiny`; `rebuild` builds it from the recipe again (not its base)."""
    base = ensure_tiny(progress=progress)  # outside our lock: it takes its own
    target = tiny_tools_dir(recipe)
    return build_once(
        target,
        lambda staging: build_tiny_tools(base, staging, recipe, progress=progress),
        shipped=SHIPPED_BUILDS / target.name,
        rebuild=rebuild,
    )


def episode_rows(
    tokenizer: PreTrainedTokenizerBase, prompt: str, turns: list[tuple[str, bool]]
) -> list[tuple[list[int], list[int]]]:
    """(context ids, model-turn ids) per model turn of a worked episode: the context is the prompt
    and every piece before the turn, environment replies included; the last turn ends with EOS.

    Pieces are tokenized one by one and concatenated, as the episode runner appends them (for the
    byte-level tiny tokenizer this equals tokenizing the joined text)."""
    context = tokenizer.encode(prompt, add_special_tokens=False)
    rows = []
    for i, (text, by_model) in enumerate(turns):
        ids = tokenizer.encode(text, add_special_tokens=False)
        if by_model:
            last = i == len(turns) - 1
            rows.append((list(context), [*ids, tokenizer.eos_token_id] if last else ids))
        context += ids
    return rows


def _sft_chunks(
    task: ToolArithTask,
    tokenizer: PreTrainedTokenizerBase,
    rng: random.Random,
    recipe: ToolWarmStartRecipe,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One step's worked episodes (a `copy_drill` share with a random tool output and answer) as
    padded (ids, labels) chunks, labelled on the model's turns only."""
    # About the range of real answers: a difference down to -10^d, a product up to 10^2d.
    low, high = -(10**recipe.max_digits), 10 ** (2 * recipe.max_digits)
    rows = []
    for _ in range(recipe.batch_size):
        ex = task.sample(rng)
        answer = str(rng.randint(low, high)) if rng.random() < recipe.copy_drill else ex.answer
        rows += episode_rows(tokenizer, ex.prompt, worked_turns(ex.meta["expression"], answer))
    return completion_chunks(rows, tokenizer.pad_token_id, recipe.chunks)


def build_tiny_tools(
    base: Path, out: Path, recipe: ToolWarmStartRecipe, *, progress: bool = True
) -> dict:
    """Fine-tune the model in `base` on worked tool episodes and save it to `out`."""
    start = time.perf_counter()
    torch.manual_seed(recipe.seed)
    model = LlamaForCausalLM.from_pretrained(base)
    tokenizer = AutoTokenizer.from_pretrained(base)
    task = recipe.task()
    rng = random.Random(recipe.seed)
    history = SFTLoop(model, recipe.lr, weight_decay=0.01).run(
        lambda: backward_token_mean(model, _sft_chunks(task, tokenizer, rng, recipe)),
        recipe.steps,
        label="building the tiny-tools model (one-off)",
        progress=progress,
    )
    loss_sum = history[-1].loss if history else float("nan")
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    info = {
        "recipe": asdict(recipe),
        "recipe_version": TINY_TOOLS_RECIPE_VERSION,
        "base": base.name,
        "final_loss": round(loss_sum, 4),
        "train_seconds": round(time.perf_counter() - start, 1),
    }
    (out / "build.json").write_text(json.dumps(info, indent=2))
    return info
