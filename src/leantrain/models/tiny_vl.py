"""The `tiny-vl` preset: a Llava-style vision-language model made of standard transformers parts,
a 2-layer CLIP vision tower and a 2-layer MLP projector in front of the `tiny-tools` Llama, warm
-started on its own rendered data (tasks/visual.py) so that visual tool GRPO
(`configs/tiny-vl-tools.yaml`) starts from a policy that reads numbers off an image, calls the
Python tool and copies its output, some of the time.

    image (64x64) -> CLIP patches (8x8, one glyph each; 64 of them) -> projector -> 64 image
    tokens in the LM's embedding space -> tiny-tools Llama (its weights copied, `<image>` added)

Two warm-start stages, each stopped early on purpose:
1. Reading. The vision tower and projector learn to map each glyph patch onto the LM's input
   embedding of that character (MSE to the frozen embedding row; an empty cell maps to a space),
   on random character grids of random colours and positions: generic reading, no task. The LM
   then sees an image much as it sees text, and its text skills (copying digits) carry over.
2. Task. The projector and the LM (the vision tower stays as stage 1 left it) are fine-tuned on
   worked `visual` episodes of the in-domain `receipt` style (never the held-out `tags` style),
   loss on the model's turns only (the environment's reply is read, never trained on), as
   `tiny-tools` is on `tool_arith`.

Built on first use, cached under `$LEANTRAIN_HOME/models/` as an ordinary Hugging Face folder with
its processor (`AutoProcessor` / `AutoModelForImageTextToText.from_pretrained(folder)`), one
builder at a time through a staging folder. `tiny_vl_model` builds an untrained one in
milliseconds (tests). Knows nothing about RL.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import (
    AutoTokenizer,
    CLIPVisionConfig,
    LlamaForCausalLM,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaProcessor,
)
from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

from leantrain.models.build_cache import build_once
from leantrain.models.finetune import IGNORE
from leantrain.models.tiny import leantrain_home
from leantrain.models.tiny_tools import ensure_tiny_tools
from leantrain.models.vision import encode_image_prompt
from leantrain.tasks.tool_arith import worked_turns
from leantrain.tasks.visual import (
    CELL,
    GLYPHS,
    GRID,
    IMAGE_SIZE,
    IMAGE_TOKEN,
    VisualTask,
    render_grid,
)

# Bump when the recipe below changes, so stale caches are rebuilt instead of reused.
TINY_VL_RECIPE_VERSION = 2


@dataclass(frozen=True)
class VisionWarmStartRecipe:
    """Warm start of `tiny-vl` from `tiny-tools`.

    Attributes:
        seed: fixes initialization and data; the same seed builds the same weights.
        vision_hidden: width of the CLIP vision tower.
        vision_layers: its transformer layers.
        read_steps: stage 1 (reading) optimizer steps, vision tower and projector only.
        read_batch: random glyph grids per reading step.
        read_lr: stage 1 AdamW learning rate.
        task_steps: stage 2 (task) optimizer steps, projector and LM; few enough that the
            in-domain answer comes out right only part of the time, leaving GRPO room. Greedy
            on 64 new images: 4.7% of receipts, 1.6% of held-out tags (recipe v1, whose
            clipping norm also counted the frozen tower's piled-up gradients and so damped
            the later steps, reached 22% and 6%).
            Build: 155 s of CPU on one thread (502 s wall on a 2-core CPU shared with other
            jobs); with torch's default 2 threads on that busy machine it took 1123 s.
        task_batch: worked receipt episodes per task step.
        task_lr: stage 2 AdamW learning rate.
        max_value: largest number on a training receipt (`configs/tiny-vl-tools.yaml` uses the
            same).
    """

    seed: int = 0
    vision_hidden: int = 64
    vision_layers: int = 2
    read_steps: int = 300
    read_batch: int = 32
    read_lr: float = 3e-3
    task_steps: int = 360
    task_batch: int = 16
    task_lr: float = 2e-3
    max_value: int = 30


def tiny_vl_dir(recipe: VisionWarmStartRecipe = VisionWarmStartRecipe()) -> Path:
    return leantrain_home() / "models" / f"tiny-vl-v{TINY_VL_RECIPE_VERSION}-seed{recipe.seed}"


def ensure_tiny_vl(
    recipe: VisionWarmStartRecipe = VisionWarmStartRecipe(), *, progress: bool = True
) -> Path:
    """Return the cached `tiny-vl` folder, building it first if needed."""
    base = ensure_tiny_tools(progress=progress)  # outside our lock: it takes its own
    return build_once(
        tiny_vl_dir(recipe),
        lambda staging: build_tiny_vl(base, staging, recipe, progress=progress),
    )


def tiny_vl_model(
    base: Path, recipe: VisionWarmStartRecipe = VisionWarmStartRecipe()
) -> tuple[LlavaForConditionalGeneration, LlavaProcessor]:
    """An untrained Llava model around the Llama LM in `base` (its weights copied, the `<image>`
    token added) with a freshly initialised vision tower and projector, and its processor."""
    torch.manual_seed(recipe.seed)
    lm = LlamaForCausalLM.from_pretrained(base)
    tokenizer = AutoTokenizer.from_pretrained(base)
    tokenizer.add_tokens([IMAGE_TOKEN], special_tokens=True)
    lm.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    vision = CLIPVisionConfig(
        hidden_size=recipe.vision_hidden,
        intermediate_size=4 * recipe.vision_hidden,
        num_hidden_layers=recipe.vision_layers,
        num_attention_heads=4,
        image_size=IMAGE_SIZE,
        patch_size=CELL,  # one patch per glyph cell
    )
    config = LlavaConfig(
        vision_config=vision,
        text_config=lm.config,
        image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        vision_feature_select_strategy="default",  # the patches; the CLS feature is dropped
        vision_feature_layer=-1,
        projector_hidden_act="gelu",
        tie_word_embeddings=lm.config.tie_word_embeddings,
    )
    model = LlavaForConditionalGeneration(config)
    model.model.language_model.load_state_dict(lm.model.state_dict())
    model.lm_head.load_state_dict(lm.lm_head.state_dict())
    image_processor = CLIPImageProcessorPil(
        size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    )
    processor = LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=CELL,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,  # CLIP's CLS, counted then dropped
        image_token=IMAGE_TOKEN,
    )
    return model.eval(), processor


def _reading_batch(
    processor: LlavaProcessor, rng: random.Random, n: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`n` random glyph grids: pixel values (n, 3, 64, 64) and each cell's character id
    (n, 64), row-major like the patches."""
    tokenizer = processor.tokenizer
    char_ids = {c: tokenizer.encode(c, add_special_tokens=False)[0] for c in GLYPHS + " "}
    images, targets = [], []
    for _ in range(n):
        fill = rng.uniform(0.1, 0.6)  # share of non-empty cells
        rows = [
            "".join(rng.choice(GLYPHS) if rng.random() < fill else " " for _ in range(GRID))
            for _ in range(GRID)
        ]
        paper = tuple(rng.randint(190, 255) for _ in range(3))
        ink = tuple(rng.randint(0, 100) for _ in range(3))
        offset = (rng.randint(0, 2), rng.randint(0, 1))
        images.append(render_grid(dict(enumerate(rows)), paper=paper, ink=ink, offset=offset))
        targets.append([char_ids[c] for row in rows for c in row])
    pixels = processor.image_processor(images, return_tensors="pt")["pixel_values"]
    return pixels, torch.tensor(targets)


def _episode_batch(
    processor: LlavaProcessor, task: VisualTask, rng: random.Random, n: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`n` worked episodes as right-padded (ids, labels) (n, T) and their pixel values: one row
    per episode (prompt, model turn, environment reply, model turn, EOS), labelled on the
    model's turns only. Right padding needs no attention mask in a causal model."""
    tokenizer = processor.tokenizer
    rows, pixels = [], []
    for _ in range(n):
        ex = task.sample(rng)
        ids, pixel_values = encode_image_prompt(processor, ex.prompt, [ex.meta["image"]])
        labels = [IGNORE] * len(ids)
        for text, by_model in worked_turns(ex.meta["expression"], ex.answer):
            piece = tokenizer.encode(text, add_special_tokens=False)
            ids += piece
            labels += piece if by_model else [IGNORE] * len(piece)
        ids.append(tokenizer.eos_token_id)
        labels.append(tokenizer.eos_token_id)
        rows.append((ids, labels))
        pixels.append(pixel_values)
    width = max(len(ids) for ids, _ in rows)
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([ids + [pad] * (width - len(ids)) for ids, _ in rows])
    labels = torch.tensor([lab + [IGNORE] * (width - len(lab)) for _, lab in rows])
    return input_ids, labels, torch.cat(pixels)


def build_tiny_vl(
    base: Path, out: Path, recipe: VisionWarmStartRecipe, *, progress: bool = True
) -> dict:
    """Build `tiny-vl` around the LM in `base` (two warm-start stages) and save it to `out`."""
    from rich.progress import Progress

    start = time.perf_counter()
    model, processor = tiny_vl_model(base, recipe)
    rng = random.Random(recipe.seed)
    embeddings = model.get_input_embeddings().weight.detach()  # (V, H), the reading targets
    tower, projector = model.model.vision_tower, model.model.multi_modal_projector
    task = VisualTask(style="receipt", max_value=recipe.max_value)
    stages = (  # (name, steps, learning rate, the modules that train)
        ("reading", recipe.read_steps, recipe.read_lr, [tower, projector]),
        # The vision tower stays as stage 1 made it: generic reading, not receipt-specific.
        ("task", recipe.task_steps, recipe.task_lr, [projector, model.model.language_model]),
    )
    losses: dict[str, float] = {}
    model.train()
    with Progress(disable=not progress, transient=True) as bar:
        job = bar.add_task(
            "building tiny-vl (one-off)", total=recipe.read_steps + recipe.task_steps
        )
        for stage, steps, lr, modules in stages:
            model.requires_grad_(False)
            for module in modules:
                module.requires_grad_(True)
            params = [p for p in model.parameters() if p.requires_grad]  # lm_head is tied
            opt = torch.optim.AdamW(params, lr=lr)
            for _ in range(steps):
                if stage == "reading":
                    pixels, chars = _reading_batch(processor, rng, recipe.read_batch)
                    features = model.get_image_features(pixel_values=pixels).pooler_output
                    loss = F.mse_loss(torch.stack(features), embeddings[chars])
                else:
                    ids, labels, pixels = _episode_batch(processor, task, rng, recipe.task_batch)
                    loss = model(
                        input_ids=ids, pixel_values=pixels, labels=labels, use_cache=False
                    ).loss
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)
                losses[stage] = float(loss.detach())
                bar.update(
                    job, advance=1, description=f"building tiny-vl: {stage} {losses[stage]:.3f}"
                )
    model.requires_grad_(True).eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    info = {
        "recipe": asdict(recipe),
        "recipe_version": TINY_VL_RECIPE_VERSION,
        "base": base.name,
        "final_loss": {k: round(v, 4) for k, v in losses.items()},
        "train_seconds": round(time.perf_counter() - start, 1),
        "parameters": sum(p.numel() for p in model.parameters()),
    }
    (out / "build.json").write_text(json.dumps(info, indent=2))
    return info
