"""The `tiny-vl` preset: a Llava-style vision-language model made of standard transformers parts,
a 2-layer CLIP vision tower and a 2-layer MLP projector in front of the `tiny-tools` Llama, warm
-started on its own rendered data (tasks/visual.py) so that visual tool GRPO
(`configs/tiny-vl-tools.yaml`) starts from a policy that transcribes an image and then answers,
calling the Python tool some of the time.

    image (64x64) -> CLIP patches (8x8, one glyph each; 64 of them) -> projector -> 64 image
    tokens in the LM's embedding space -> tiny-tools Llama (its weights copied, `<image>` added)

Three warm-start stages (recipe v4; v3, the glyph and task stages alone, is
`VisionWarmStartRecipe(task_styles=("receipt",), reading_steps=0, read_batch=0,
task_stop_accuracy=0.15, task_transcribe=False, task_direct_share=0.0, task_read_batch=0)`):
1. Glyphs (generic visual reading, no task). The vision tower and projector learn to map each
   glyph patch onto the LM's input embedding of that character (an empty cell onto a space), on
   random character grids of random ink and paper colours and glyph positions: the squared
   distance to the embedding row plus a cross-entropy that keeps each feature nearer its own
   character than any other. The LM then sees an image much as it sees text. (Recipe v2 used
   the squared distance alone and its tower misread half of the inked cells; this one reads all
   of them, on receipts and on the held-out tags: `glyph_accuracy`, recorded in `build.json`.)
2. Reading (`reading_steps`). The projector and the LM learn to transcribe random pages of
   random glyph words at random rows and columns (`<image>read?` -> what they say; never a
   tags card): OCR pretraining, as real VLMs get before task tuning (LLaVA's stage 1).
3. Task. The projector and the LM (the vision tower stays as stage 1 left it) are fine-tuned on
   worked `visual` episodes of the in-domain styles `task_styles` (receipts, tables and pages;
   never the held-out `tags` style), loss on the model's turns only (the environment's reply is
   read, never trained on), as `tiny-tools` is on `tool_arith`. The episodes read first
   (`task_transcribe`: `total?\\n<image>read?\\n`, the transcription, then the call), and
   `task_direct_share` of them answer after the reading without the tool, so that the start has
   not settled on its tool and GRPO has the call to learn. Every batch also holds generic pages
   (`read_batch`) and task images (`task_read_batch`) to transcribe, so that the reading stays
   generic and only the question tells reading from adding.

Shipped with the package (about 950 s of CPU to build; a first use copies it) and cached under
`$LEANTRAIN_HOME/models/` as an ordinary Hugging Face folder with its processor (`AutoProcessor` /
`AutoModelForImageTextToText.from_pretrained(folder)`); another recipe is built on first use, one
builder at a time through a staging folder. `tiny_vl_model` builds an untrained one in
milliseconds (tests). Knows nothing about RL.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from PIL import Image
from transformers import (
    AutoTokenizer,
    CLIPVisionConfig,
    LlamaForCausalLM,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaProcessor,
)
from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

from leantrain.errors import LeantrainError
from leantrain.models.build_cache import SHIPPED_BUILDS, build_once, recipe_hash
from leantrain.models.finetune import IGNORE
from leantrain.models.presets.tiny_tools import ensure_tiny_tools, tiny_tools_dir
from leantrain.models.vision import encode_image_prompt
from leantrain.settings import leantrain_home
from leantrain.tasks.base import Example
from leantrain.tasks.visual import (
    CELL,
    GLYPHS,
    GRID,
    IMAGE_SIZE,
    IMAGE_TOKEN,
    READ_QUESTION,
    STYLES,
    VisualTask,
    evaluation_examples,
    reading_page,
    render_grid,
    text_grid,
    tinted_paper_and_ink,
    transcript,
)
from leantrain.training.sft import SFTLoop

_CELL_CHARS = GLYPHS + " "  # what a cell can hold: a glyph or nothing
_PROBE_SEED = 555  # validation images, never the benchmark's test seed (777)
_READ_CHECK_PAGES = 128  # validation pages whose exact transcription build.json records

# Bump when the recipe below changes, so stale caches are rebuilt instead of reused.
TINY_VL_RECIPE_VERSION = 4


@dataclass(frozen=True)
class VisionWarmStartRecipe:
    """Warm start of `tiny-vl` from `tiny-tools`. A recipe with any field off its default
    builds into a cache folder of its own (`tiny_vl_dir`).

    Attributes:
        seed: fixes initialization and data; the same seed builds the same weights.
        vision_hidden: width of the CLIP vision tower.
        vision_layers: its transformer layers.
        glyph_steps: stage 1 (glyphs) optimizer steps, vision tower and projector only.
        glyph_batch: random glyph grids per glyph step.
        glyph_lr: stage 1 AdamW learning rate.
        glyph_temperature: scale of the squared distances in the glyph stage's cross-entropy;
            smaller asks for a wider margin between a feature's own character and the others.
        glyph_mse_weight: weight of the squared distance to the character's embedding against
            that cross-entropy; high enough that features land on the rows, not just nearest.
        task_styles: the `visual` styles the task stage trains on (each episode draws one).
            Never `tags`: the benchmark's held-out domain. Pages (numbers among letter words,
            anywhere) make the call pick numbers out of any transcription, not one layout's.
        reading_steps: optimizer steps of the reading stage between the glyph and the task
            stages (0: none): the projector and the LM learn to transcribe random pages
            (`read?`, `reading_batch` pages a step). Its exact transcription rate on validation
            pages is in `build.json`. The loss sits near 2.8 for about 1000 steps (lr 1e-3),
            then falls (0.35 at 1500 steps: 56% of validation pages exact); it takes most of
            the build's time (about 400 of its 950 s of CPU).
        reading_batch: pages per reading step.
        reading_lr: reading stage AdamW learning rate.
        task_steps: most stage 2 (task) optimizer steps, projector and LM.
        task_batch: worked episodes per task step.
        read_batch: random pages per task step, each to transcribe (`read?`): keeps the
            reading stage's generic reading through the task stage.
        task_lr: stage 2 AdamW learning rate.
        task_stop_accuracy: the task stage stops once greedy decoding solves this share of
            validation images with the tool, equally many of each of `task_styles` (checked
            exactly, by teacher forcing), or after `task_steps` steps: a start GRPO can improve
            on. With direct answers greedy decoding does not call the tool, so the check does
            not fire and the stage runs its `task_steps`.
        task_transcribe: read first: the task episodes ask the question before the image and
            `read?` of it, and open with the image's transcription, then the tool call
            (`VisualTask`'s `transcribe`). Right after the image the context is the reading
            stage's own, so the reading stays the generic one (use with `reading_steps`).
        task_direct_share: share of the task stage's episodes that answer without the tool,
            after the reading with `task_transcribe` (`VisualTask.direct_turns`): a start that
            has not settled on calling the tool, as Visual-ARFT's base model answers without its
            tools. What GRPO then learns first is to call the tool, a behaviour that does not
            depend on the image's layout. The same number of direct answers goes into every
            batch: drawn per episode, the batches' luck moved the first token's p(call) from
            0.37 to 0.66 between two seeds. At 0.6 greedy decoding answers directly and sampling
            calls the tool in about a third of the episodes.
        task_read_batch: images of `task_styles` per task step asked `read?` (their
            transcription, then the end). With `task_transcribe`, a transcription alone then
            cannot tell the model whether to stop (`read?`) or to call the tool (`total?`): the
            question must. Without them a reading-first build read held-out cards right and
            then stopped, as `read?` does, on a layout the task never had.
        stop_check_every: steps between those checks.
        stop_check_size: validation images in each check (split evenly over `task_styles`).
        max_value: largest number on a training image (`configs/tiny-vl-tools.yaml` uses the
            same).
    """

    seed: int = 0
    vision_hidden: int = 64
    vision_layers: int = 2
    glyph_steps: int = 500
    glyph_batch: int = 32
    glyph_lr: float = 3e-3
    glyph_temperature: float = 0.01
    glyph_mse_weight: float = 300.0
    task_styles: tuple[str, ...] = ("receipt", "table", "page")
    reading_steps: int = 1500
    reading_batch: int = 16
    reading_lr: float = 1e-3
    task_steps: int = 800
    task_batch: int = 16
    read_batch: int = 8
    task_lr: float = 2e-3
    task_stop_accuracy: float = 0.3
    task_transcribe: bool = True
    task_direct_share: float = 0.6
    task_read_batch: int = 4
    stop_check_every: int = 20
    stop_check_size: int = 64
    max_value: int = 30

    def __post_init__(self) -> None:
        # A recipe that trains on the held-out style would make the benchmark's held-out domain
        # an in-domain one, silently.
        if "tags" in self.task_styles or not set(self.task_styles) <= set(STYLES):
            raise LeantrainError(
                f"tiny-vl recipe: invalid task_styles={self.task_styles!r} (styles of "
                f"{[s for s in STYLES if s != 'tags']}; never 'tags', the held-out domain)"
            )
        if not 0.0 <= self.task_direct_share <= 1.0:
            raise LeantrainError(
                f"tiny-vl recipe: invalid task_direct_share={self.task_direct_share!r} "
                "(a share of the task episodes: 0 to 1)"
            )
        for name in ("reading_steps", "read_batch", "task_read_batch"):
            if getattr(self, name) < 0:  # a count of steps or rows; 0 is none
                raise LeantrainError(
                    f"tiny-vl recipe: invalid {name}={getattr(self, name)!r} (a count: 0 or more)"
                )


# Readable cache-folder tags of the recipe fields builds change most; any other field that
# differs from its default is tagged `<name><value>`.
_DIR_TAGS = {
    "task_styles": lambda styles: "+".join(styles),
    "reading_steps": lambda steps: f"read{steps}",
    "read_batch": lambda pages: f"pages{pages}",
}


def tiny_vl_dir(recipe: VisionWarmStartRecipe = VisionWarmStartRecipe()) -> Path:
    """The cache folder of `recipe`'s build: the recipe version and seed, a readable tag for every
    field that differs from its default, then the hash of the whole recipe and its base, so that
    a build never reuses another recipe's weights."""
    default = VisionWarmStartRecipe(seed=recipe.seed)
    tags = []
    for spec in fields(recipe):
        value = getattr(recipe, spec.name)
        if isinstance(value, list):
            value = tuple(value)  # a recipe read from JSON or YAML
        if value != getattr(default, spec.name):
            tag = _DIR_TAGS.get(spec.name)
            tags.append(tag(value) if tag else f"{spec.name}{value}")
    tags.append(recipe_hash(recipe, version=TINY_VL_RECIPE_VERSION, base=tiny_tools_dir().name))
    name = "-".join([f"tiny-vl-v{TINY_VL_RECIPE_VERSION}-seed{recipe.seed}", *tags])
    return leantrain_home() / "models" / name


def ensure_tiny_vl(
    recipe: VisionWarmStartRecipe = VisionWarmStartRecipe(),
    *,
    progress: bool = True,
    rebuild: bool = False,
) -> Path:
    """Return the cached `tiny-vl` folder, first copied from the shipped build of `recipe` or
    built on the cached `tiny-tools`; `rebuild` builds it from the recipe again (not its base)."""
    base = ensure_tiny_tools(progress=progress)  # outside our lock: it takes its own
    target = tiny_vl_dir(recipe)
    return build_once(
        target,
        lambda staging: build_tiny_vl(base, staging, recipe, progress=progress),
        shipped=SHIPPED_BUILDS / target.name,
        rebuild=rebuild,
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


def _glyph_batch(
    processor: LlavaProcessor, rng: random.Random, n: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`n` random glyph grids: pixel values (n, 3, 64, 64) and each cell's position in
    `GLYPHS + " "` (n, 64), row-major like the patches."""
    images, targets = [], []
    for _ in range(n):
        fill = rng.uniform(0.1, 0.6)  # share of non-empty cells
        rows = [
            "".join(rng.choice(GLYPHS) if rng.random() < fill else " " for _ in range(GRID))
            for _ in range(GRID)
        ]
        paper, ink = tinted_paper_and_ink(rng)
        offset = (rng.randint(0, 2), rng.randint(0, 1))
        images.append(render_grid(dict(enumerate(rows)), paper=paper, ink=ink, offset=offset))
        targets.append([_CELL_CHARS.index(c) for row in rows for c in row])
    pixels = processor.image_processor(images, return_tensors="pt")["pixel_values"]
    return pixels, torch.tensor(targets)


def _glyph_loss(
    features: torch.Tensor, targets: torch.Tensor, rows: torch.Tensor, recipe: VisionWarmStartRecipe
) -> torch.Tensor:
    """How far patch features (n, 64, H) are from the LM's embedding rows (C, H) of their cells'
    characters (`targets` (n, 64), indices into `rows`): the squared distance (so the LM sees the
    image much as it sees the text) plus a cross-entropy over the negated squared distances to
    every glyph's row (so each feature is nearer its own character than any other: MSE alone
    left v2 confusing half of the inked cells)."""
    mse = F.mse_loss(features, rows[targets])
    distances = torch.cdist(features.flatten(0, 1), rows).pow(2)  # (n * 64, C)
    nearest = F.cross_entropy(-distances / recipe.glyph_temperature, targets.flatten())
    return recipe.glyph_mse_weight * mse + nearest


@torch.no_grad()
def glyph_accuracy(
    model: LlavaForConditionalGeneration, processor: LlavaProcessor, examples: list[Example]
) -> float:
    """Reading probe of the vision side: the share of the inked cells of `examples`' images whose
    image feature lies nearer the LM's current input embedding of that cell's character than
    any other glyph's (or a space's): what the LM can read off the image tokens at best."""
    tokenizer = processor.tokenizer
    rows = model.get_input_embeddings().weight[
        [tokenizer.encode(c, add_special_tokens=False)[0] for c in _CELL_CHARS]
    ]
    pixels = processor.image_processor([ex.meta["image"] for ex in examples], return_tensors="pt")[
        "pixel_values"
    ].to(rows.device, rows.dtype)
    features = torch.stack(model.get_image_features(pixel_values=pixels).pooler_output)
    read = torch.cdist(features.flatten(0, 1), rows).argmin(-1)  # (n * 64,)
    truth = torch.tensor([_CELL_CHARS.index(c) for ex in examples for c in ex.meta["cells"]])
    inked = truth != _CELL_CHARS.index(" ")
    return float((read[inked] == truth[inked]).float().mean())


@torch.no_grad()
def episode_accuracy(
    model: LlavaForConditionalGeneration, processor: LlavaProcessor, rows: list
) -> float:
    """The share of worked episodes `rows` (as `_episode_rows` makes them) whose every model
    token (EOS included) is the model's argmax given what precedes it: the share that greedy
    decoding solves, the environment's reply being the one a right call gets; one forward pass.
    On transcription rows (`_reading_rows`): the share of pages greedy decoding reads exactly."""
    ids, labels, pixels = _sequence_batch(processor, rows)
    logits = model(input_ids=ids, pixel_values=pixels, use_cache=False).logits  # (n, T, V)
    predicted, wanted = logits[:, :-1].argmax(-1), labels[:, 1:]  # position t predicts t + 1
    trained = wanted != IGNORE
    return float(((predicted == wanted) | ~trained).all(-1).float().mean())


def _probe_images(style: str) -> list[Example]:
    return evaluation_examples(style, 64, _PROBE_SEED)


def _sequence_batch(
    processor: LlavaProcessor, rows: list[tuple[str, Image.Image, list[tuple[str, bool]]]]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded (ids, labels) (n, T) and pixel values (n, 3, 64, 64) of `rows`, each an image
    prompt and the pieces that follow it, (text, trained on), then EOS (trained on). Right
    padding needs no attention mask in a causal model."""
    tokenizer = processor.tokenizer
    encoded, pixels = [], []
    for prompt, image, pieces in rows:
        ids, pixel_values = encode_image_prompt(processor, prompt, [image])
        labels = [IGNORE] * len(ids)
        for text, trained in pieces:
            piece = tokenizer.encode(text, add_special_tokens=False)
            ids += piece
            labels += piece if trained else [IGNORE] * len(piece)
        ids.append(tokenizer.eos_token_id)
        labels.append(tokenizer.eos_token_id)
        encoded.append((ids, labels))
        pixels.append(pixel_values)
    width = max(len(ids) for ids, _ in encoded)
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([ids + [pad] * (width - len(ids)) for ids, _ in encoded])
    labels = torch.tensor([lab + [IGNORE] * (width - len(lab)) for _, lab in encoded])
    return input_ids, labels, torch.cat(pixels)


def _reading_rows(rng: random.Random, n: int) -> list:
    """`n` generic transcriptions: a random page, `read?`, what it says."""
    rows = []
    for _ in range(n):
        lines, image = reading_page(rng)
        rows.append(_reading_row(image, transcript(text_grid(lines))))
    return rows


def _task_reading_rows(task: VisualTask, rng: random.Random, n: int) -> list:
    """`n` images of `task`'s styles, `read?`, what they say (then the end, not a tool call)."""
    examples = [task.sample(rng) for _ in range(n)]
    return [_reading_row(ex.meta["image"], ex.meta["transcript"]) for ex in examples]


def _reading_row(image: Image.Image, text: str) -> tuple:
    return (f"{IMAGE_TOKEN}{READ_QUESTION}\n", image, [(text, True)])


def _episode_rows(task: VisualTask, rng: random.Random, n: int, direct_share: float = 0.0) -> list:
    """`n` worked episodes (prompt, model turn, environment reply, model turn), trained on the
    model's turns only: the environment's reply is read, never trained on. `direct_share` of
    them (rounded; the same number in every batch, so that the share the model's first token
    learns does not wander with the batches' luck) answer without the tool
    (`VisualTask.direct_turns`)."""
    examples = [task.sample(rng) for _ in range(n)]
    if not direct_share:  # draws nothing more: a recipe without it builds as it always did
        return _worked_rows(task, examples)
    direct = set(rng.sample(range(n), round(direct_share * n)))
    return [
        (
            ex.prompt,
            ex.meta["image"],
            task.direct_turns(ex) if i in direct else task.worked_turns(ex),
        )
        for i, ex in enumerate(examples)
    ]


def _validation_rows(task: VisualTask, recipe: VisionWarmStartRecipe) -> dict[str, list]:
    """The task stage's stop check: worked episodes of validation images of each of `task`'s
    styles (`stop_check_size` split evenly), with the task's own prompt and options."""
    per_style = max(1, recipe.stop_check_size // len(task.styles))
    return {
        style: _worked_rows(
            task,
            evaluation_examples(
                style, per_style, _PROBE_SEED, max_value=task.max_value, transcribe=task.transcribe
            ),
        )
        for style in task.styles
    }


def _worked_rows(task: VisualTask, examples: list[Example]) -> list:
    """The worked episode of each example as `task` solves it, as `_episode_rows` makes them."""
    return [(ex.prompt, ex.meta["image"], task.worked_turns(ex)) for ex in examples]


def build_tiny_vl(
    base: Path, out: Path, recipe: VisionWarmStartRecipe, *, progress: bool = True
) -> dict:
    """Build `tiny-vl` around the LM in `base` (three warm-start stages) and save it to `out`."""
    start = time.process_time()
    model, processor = tiny_vl_model(base, recipe)
    rng = random.Random(recipe.seed)
    tokenizer = processor.tokenizer
    cell_ids = [tokenizer.encode(c, add_special_tokens=False)[0] for c in _CELL_CHARS]
    glyph_rows = model.get_input_embeddings().weight.detach()[cell_ids]  # (C, H), fixed targets
    tower, projector = model.model.vision_tower, model.model.multi_modal_projector
    lm = model.model.language_model
    task = VisualTask(
        style=recipe.task_styles, max_value=recipe.max_value, transcribe=recipe.task_transcribe
    )

    def glyph_loss() -> torch.Tensor:
        pixels, targets = _glyph_batch(processor, rng, recipe.glyph_batch)
        features = torch.stack(model.get_image_features(pixel_values=pixels).pooler_output)
        return _glyph_loss(features, targets, glyph_rows, recipe)

    def sequence_loss(rows: list) -> torch.Tensor:
        ids, labels, pixels = _sequence_batch(processor, rows)
        return model(input_ids=ids, pixel_values=pixels, labels=labels, use_cache=False).loss

    def reading_loss() -> torch.Tensor:
        return sequence_loss(_reading_rows(rng, recipe.reading_batch))

    def task_loss() -> torch.Tensor:
        rows = _episode_rows(task, rng, recipe.task_batch, recipe.task_direct_share)
        rows += _reading_rows(rng, recipe.read_batch)
        rows += _task_reading_rows(task, rng, recipe.task_read_batch)
        return sequence_loss(rows)

    validation = _validation_rows(task, recipe)
    validation_rows = [row for rows in validation.values() for row in rows]
    validation_pages = _reading_rows(random.Random(_PROBE_SEED), _READ_CHECK_PAGES)
    losses: dict[str, float] = {}

    def train(stage: str, modules: list, lr: float, steps: int, batch_loss, stop=None) -> int:
        """`steps` AdamW steps on `modules` (the tied lm_head trains with the embeddings), or
        fewer once `stop()` (checked every `stop_check_every` steps) says so; returns the steps
        taken."""
        model.requires_grad_(False)
        for module in modules:
            module.requires_grad_(True)

        def backward() -> float:
            loss = batch_loss()
            loss.backward()
            return float(loss.detach())

        history = SFTLoop(model, lr, weight_decay=0.01).run(
            backward,
            steps,
            label=f"building tiny-vl (one-off): {stage}",
            progress=progress,
            stop=None
            if stop is None
            else lambda stats: stats.step % recipe.stop_check_every == 0 and stop(),
        )
        if history:
            losses[stage] = history[-1].loss
        return len(history)

    train("glyphs", [tower, projector], recipe.glyph_lr, recipe.glyph_steps, glyph_loss)
    # What the vision side reads before the LM learns the task (validation images).
    glyphs_read = {
        style: round(glyph_accuracy(model, processor, _probe_images(style)), 3) for style in STYLES
    }
    if recipe.reading_steps:
        train("reading", [projector, lm], recipe.reading_lr, recipe.reading_steps, reading_loss)
    # Exact transcriptions of validation pages, before and after the task stage.
    pages_read = {"before_task": round(episode_accuracy(model, processor, validation_pages), 3)}
    # The vision tower stays as the glyph stage made it: generic, not receipt-specific. The
    # task stage stops once greedy decoding solves `task_stop_accuracy` of the validation
    # images: where that happens moves with the data order, the accuracy does not.
    task_steps = train(
        "task",
        [projector, lm],
        recipe.task_lr,
        recipe.task_steps,
        task_loss,
        stop=lambda: (
            episode_accuracy(model, processor, validation_rows) >= recipe.task_stop_accuracy
        ),
    )
    start_accuracy = {
        style: round(episode_accuracy(model, processor, rows), 3)
        for style, rows in validation.items()
    }
    pages_read["after_task"] = round(episode_accuracy(model, processor, validation_pages), 3)
    model.requires_grad_(True).eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    info = {
        "recipe": asdict(recipe),
        "recipe_version": TINY_VL_RECIPE_VERSION,
        "base": base.name,
        "final_loss": {k: round(v, 4) for k, v in losses.items()},
        "glyph_accuracy_after_glyphs": glyphs_read,
        "validation_pages_transcribed": pages_read,
        "task_steps_taken": task_steps,
        "validation_task_accuracy": start_accuracy,
        "train_cpu_seconds": round(time.process_time() - start, 1),
        "parameters": sum(p.numel() for p in model.parameters()),
    }
    (out / "build.json").write_text(json.dumps(info, indent=2))
    return info
