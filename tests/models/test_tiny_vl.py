"""The tiny VLM: standard transformers parts around the tiny Llama, saved as an ordinary HF folder
whose processor round-trips an image prompt, loadable through `load_model` like any VLM."""

from __future__ import annotations

import json
import random

import pytest
import torch
from transformers import AutoProcessor, LlamaForCausalLM, LlavaForConditionalGeneration

from leantrain.models import PRESETS, load_model
from leantrain.models.tiny_vl import VisionWarmStartRecipe, build_tiny_vl, tiny_vl_model
from leantrain.models.vision import encode_image_prompt, load_processor
from leantrain.tasks.visual import GRID, VisualTask


@pytest.fixture(scope="module")
def saved_vlm(tiny_path, tmp_path_factory):
    model, processor = tiny_vl_model(tiny_path)
    folder = tmp_path_factory.mktemp("tiny-vl")
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder, model, processor


def test_processor_round_trips_an_image_prompt(saved_vlm):
    folder, _, processor = saved_vlm
    ex = VisualTask().sample(random.Random(0))
    ids, pixels = encode_image_prompt(processor, ex.prompt, [ex.meta["image"]])
    reloaded = AutoProcessor.from_pretrained(folder)
    again_ids, again_pixels = encode_image_prompt(reloaded, ex.prompt, [ex.meta["image"]])
    assert again_ids == ids
    assert torch.equal(again_pixels, pixels)
    assert pixels.shape == (1, 3, 64, 64)
    # One image token per 8x8 patch, then the question as text.
    image_id = reloaded.tokenizer.convert_tokens_to_ids("<image>")
    assert ids.count(image_id) == GRID * GRID == ids[: GRID * GRID].count(image_id)
    assert reloaded.tokenizer.decode(ids[GRID * GRID :]) == "total?\n"


def test_load_model_loads_the_vlm_folder_with_its_processor(saved_vlm):
    folder, model, _ = saved_vlm
    loaded, tokenizer = load_model(folder)
    assert isinstance(loaded, LlavaForConditionalGeneration)
    assert not loaded.training
    ex = VisualTask(style="tags").sample(random.Random(1))
    ids, pixels = encode_image_prompt(load_processor(folder), ex.prompt, [ex.meta["image"]])
    with torch.no_grad():
        want = model(input_ids=torch.tensor([ids]), pixel_values=pixels).logits
        got = loaded(input_ids=torch.tensor([ids]), pixel_values=pixels).logits
    assert torch.allclose(want, got, atol=1e-6)
    assert tokenizer.convert_tokens_to_ids("<image>") == loaded.config.image_token_id


def test_the_language_model_is_the_base_model(saved_vlm, tiny_path):
    _, model, processor = saved_vlm
    base = LlamaForCausalLM.from_pretrained(tiny_path)
    ids = torch.tensor([processor.tokenizer.encode("sum 3 4 5\n", add_special_tokens=False)])
    with torch.no_grad():
        want = base(input_ids=ids).logits
        got = model(input_ids=ids).logits[..., : want.shape[-1]]  # + the <image> row
    assert torch.allclose(want, got, atol=1e-5)
    assert model.lm_head.weight is model.model.language_model.embed_tokens.weight  # still tied


def test_build_writes_a_loadable_folder(tiny_path, tmp_path):
    recipe = VisionWarmStartRecipe(read_steps=2, read_batch=2, task_steps=2, task_batch=2)
    info = build_tiny_vl(tiny_path, tmp_path / "built", recipe, progress=False)
    assert set(info["final_loss"]) == {"reading", "task"}
    assert json.loads((tmp_path / "built" / "build.json").read_text())["recipe"]["read_steps"] == 2
    model, _ = load_model(tmp_path / "built")
    assert isinstance(model, LlavaForConditionalGeneration)
    assert load_processor(tmp_path / "built").image_token == "<image>"
    assert "tiny-vl" in PRESETS
