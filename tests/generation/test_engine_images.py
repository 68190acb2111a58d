"""The rollout engine on a vision-language model: prompts with images (pixel values in the prefill),
batched with text prompts, give the logprobs a fresh forward with the same pixel values gives."""

from __future__ import annotations

import pytest
import torch

from leantrain.errors import LeantrainError
from leantrain.generation import Engine, SamplingParams
from leantrain.models.presets.tiny_vl import tiny_vl_model
from leantrain.models.vision import encode_image_prompt
from leantrain.tasks.visual import VisualTask


@pytest.fixture(scope="module")
def vlm(tiny_path):
    model, processor = tiny_vl_model(tiny_path)
    # An untrained projector yields near-zero features; widen it so images visibly matter.
    with torch.no_grad():
        for p in model.model.multi_modal_projector.parameters():
            p.mul_(20.0)
    return model, processor


@pytest.fixture(scope="module")
def image_prompts(vlm):
    _, processor = vlm
    examples = VisualTask(style="receipt").examples(2, seed=0) + VisualTask(style="tags").examples(
        1, seed=1
    )
    return [encode_image_prompt(processor, ex.prompt, [ex.meta["image"]]) for ex in examples]


def _fresh_logprobs(model, prompt, response, pixel_values, temperature):
    ids = torch.tensor([prompt + response])
    extra = {} if pixel_values is None else {"pixel_values": pixel_values}
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False, **extra).logits[0].float()
    logits = logits[len(prompt) - 1 : -1] / temperature  # (R, V): predicts each response token
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


def test_batched_image_prompts_match_a_fresh_forward(vlm, image_prompts):
    model, processor = vlm
    text_prompt = processor.tokenizer.encode("calc 12+7\n", add_special_tokens=False)
    prompts = [ids for ids, _ in image_prompts] + [text_prompt]
    images = [pv for _, pv in image_prompts] + [None]
    params = SamplingParams(max_new_tokens=10, temperature=0.8)
    # Batches of 2: rows are admitted, finish and leave at different steps.
    engine = Engine(model, processor.tokenizer, max_batch_size=2)
    completions = engine.generate(prompts, params, seed=0, images=images)
    for c, pv in zip(completions, images, strict=True):
        fresh = _fresh_logprobs(model, c.prompt_ids, c.response_ids, pv, params.temperature)
        assert torch.allclose(torch.tensor(c.logprobs), fresh, atol=1e-4)
    # The same prompt ids with another image give other logprobs: the pixels reach the model.
    ids, pv = image_prompts[0]
    swapped = engine.generate([ids], params, seed=0, images=[image_prompts[2][1]])[0]
    first = _fresh_logprobs(model, ids, swapped.response_ids[:1], pv, params.temperature)
    assert abs(float(first[0]) - swapped.logprobs[0]) > 1e-3


def test_image_arguments_are_checked(vlm, image_prompts, tiny_path):
    model, processor = vlm
    engine = Engine(model, processor.tokenizer)
    params = SamplingParams(max_new_tokens=2, temperature=0.0)
    ids, pv = image_prompts[0]
    with pytest.raises(LeantrainError, match="image tokens but no images"):
        engine.generate([ids], params)
    with pytest.raises(LeantrainError, match="one per prompt"):
        engine.generate([ids], params, images=[pv, pv])
    with pytest.raises(LeantrainError, match=r"images\[0\] is None"):
        engine.generate([ids], params, images=[None])
    with pytest.raises(LeantrainError, match=r"\(n_images, C, H, W\)"):
        engine.generate([ids], params, images=[pv[0]])
    from leantrain.models import load_model

    text_model, tokenizer = load_model(tiny_path)
    with pytest.raises(LeantrainError, match="takes no images"):
        Engine(text_model, tokenizer).generate([[5, 6]], params, images=[pv])
