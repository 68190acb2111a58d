"""Vision-language models: telling one from a text-only LM, loading its processor, and turning a
prompt with images into the token ids and pixel values the rollout engine and the trainer take.

A VLM here is any Hugging Face image-text-to-text model whose config has a `vision_config` and an
image token, and whose processor expands each image placeholder in the text into as many image
tokens as the vision tower yields features, the model filling those positions with the projected
features, in order (Llava and its relatives: fixed-size images, `pixel_values` of shape
(n_images, C, H, W)). Any such folder loads; models that need more inputs than `pixel_values`
(Qwen2-VL's flattened patches with `image_grid_thw`) load too, but `encode_image_prompt` and the
rollout engine pass pixel values only, so they are not supported for rollouts yet.
Knows nothing about tasks or training.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from PIL import Image
from transformers import AutoProcessor, PretrainedConfig, ProcessorMixin

from leantrain.errors import LeantrainError


def is_vision_config(config: PretrainedConfig) -> bool:
    """Whether `config` is a vision-language model's (it has a vision tower and an image token)."""
    return getattr(config, "vision_config", None) is not None


def load_processor(path: str | Path) -> ProcessorMixin:
    """The processor saved with a VLM folder (tokenizer + image processor), loaded offline."""
    try:
        return AutoProcessor.from_pretrained(path)
    except Exception as e:  # a folder without a usable processor: say so in one line
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise LeantrainError(
            f"could not load the processor of vision-language model {path}: {first_line} "
            "(save one with processor.save_pretrained(folder))"
        ) from None


def encode_image_prompt(
    processor: ProcessorMixin, text: str, images: Sequence[Image.Image]
) -> tuple[list[int], torch.Tensor]:
    """Prompt ids with each image placeholder expanded to its image tokens, and the images'
    pixel values (n_images, C, H, W), in the order the placeholders appear in `text`.

    Through the chat template when the processor's tokenizer has one, else the raw text (the
    built-in `tiny-vl`), as `models.encode_prompt` does for text prompts.
    """
    if not images:
        raise LeantrainError("encode_image_prompt needs at least one image")
    if getattr(processor, "chat_template", None):
        # The template writes the model's own placeholder; the text keeps only the question.
        token = processor.image_token
        content = [{"type": "image"} for _ in images]
        content.append({"type": "text", "text": text.replace(token, "").strip()})
        text = processor.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
        )
    encoded = processor(text=text, images=list(images), return_tensors="pt")
    extra = sorted(set(encoded) - {"input_ids", "attention_mask", "pixel_values"})
    if extra or encoded["pixel_values"].dim() != 4:
        raise NotImplementedError(
            f"{type(processor).__name__} returns {extra or 'flattened pixel values'} beside the "
            "ids: only Llava-style processors (pixel_values (n_images, C, H, W)) are supported"
        )
    return encoded["input_ids"][0].tolist(), encoded["pixel_values"]
