"""The tiny VLM: standard transformers parts around the tiny Llama, saved as an ordinary HF folder
whose processor round-trips an image prompt, loadable through `load_model` like any VLM."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace
from unittest.mock import patch

import pytest
import torch
from transformers import AutoProcessor, LlamaForCausalLM, LlavaForConditionalGeneration

from leantrain.errors import LeantrainError
from leantrain.models import PRESETS, load_model
from leantrain.models.finetune import IGNORE
from leantrain.models.presets.tiny_vl import (
    TINY_VL_RECIPE_VERSION,
    VisionWarmStartRecipe,
    _episode_rows,
    _glyph_loss,
    _reading_rows,
    _sequence_batch,
    _task_reading_rows,
    _validation_rows,
    build_tiny_vl,
    episode_accuracy,
    glyph_accuracy,
    tiny_vl_dir,
    tiny_vl_model,
)
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
    recipe = VisionWarmStartRecipe(
        glyph_steps=2,
        glyph_batch=2,
        task_styles=("receipt", "table"),
        reading_steps=2,
        reading_batch=2,
        task_steps=2,
        task_batch=2,
        read_batch=2,
        task_transcribe=True,
    )
    info = build_tiny_vl(tiny_path, tmp_path / "built", recipe, progress=False)
    assert set(info["final_loss"]) == {"glyphs", "reading", "task"}
    assert set(info["glyph_accuracy_after_glyphs"]) == {"receipt", "table", "page", "tags"}
    saved = json.loads((tmp_path / "built" / "build.json").read_text())
    assert saved["recipe"]["glyph_steps"] == 2
    assert saved["task_steps_taken"] == 2  # the first stop check comes at step 20
    # The stop check's validation images are of both training styles, never the held-out one.
    assert set(saved["validation_task_accuracy"]) == {"receipt", "table"}
    assert all(0.0 <= acc <= 1.0 for acc in saved["validation_task_accuracy"].values())
    # Exact transcriptions of validation pages, after the reading stage and after the task.
    pages = saved["validation_pages_transcribed"]
    assert set(pages) == {"before_task", "after_task"}
    assert all(0.0 <= share <= 1.0 for share in pages.values())
    model, _ = load_model(tmp_path / "built")
    assert isinstance(model, LlavaForConditionalGeneration)
    assert load_processor(tmp_path / "built").image_token == "<image>"
    assert "tiny-vl" in PRESETS
    # Another recipe is another build: every non-default field is in the folder's name, the
    # common ones by a readable tag, and the whole recipe's hash ends it, so a build never reuses
    # another recipe's weights.
    version = f"tiny-vl-v{TINY_VL_RECIPE_VERSION}-seed0"

    def name(recipe: VisionWarmStartRecipe) -> str:
        return tiny_vl_dir(recipe).name.rsplit("-", 1)[0]  # without the hash

    assert name(VisionWarmStartRecipe()) == version
    assert name(recipe) == (
        f"{version}-glyph_steps2-glyph_batch2-receipt+table-read2-reading_batch2-task_steps2"
        "-task_batch2-pages2"
    )
    plain_start = VisionWarmStartRecipe(task_transcribe=False, task_direct_share=0.0)
    assert name(plain_start) == f"{version}-task_transcribeFalse-task_direct_share0.0"
    stop_later = VisionWarmStartRecipe(task_stop_accuracy=0.45)
    assert name(stop_later) == f"{version}-task_stop_accuracy0.45"
    hashes = {tiny_vl_dir(r).name.rsplit("-", 1)[1] for r in (recipe, plain_start, stop_later)}
    assert len(hashes) == 3 and all(len(h) == 10 for h in hashes)
    # Styles read from JSON come as a list: the default's list is the default.
    default_styles = ["receipt", "table", "page"]
    assert tiny_vl_dir(VisionWarmStartRecipe(task_styles=default_styles)) == tiny_vl_dir()
    assert name(VisionWarmStartRecipe(seed=1)) == f"tiny-vl-v{TINY_VL_RECIPE_VERSION}-seed1"


def test_glyph_loss_is_lowest_on_the_embedding_rows_and_asks_for_a_margin():
    recipe = VisionWarmStartRecipe()
    rows = torch.randn(5, 8) * 0.1  # (C, H): five characters' embeddings
    targets = torch.tensor([[0, 1, 2, 3, 4, 0]])  # (n, cells)
    on_rows = _glyph_loss(rows[targets], targets, rows, recipe)
    swapped = _glyph_loss(rows[targets.roll(1, -1)], targets, rows, recipe)
    assert on_rows < swapped
    # On its row, the squared distance is 0 and the cross-entropy is that of logits -d^2 / T.
    distances = torch.cdist(rows, rows).pow(2)
    expected = torch.nn.functional.cross_entropy(
        -distances[targets[0]] / recipe.glyph_temperature, targets[0]
    )
    assert torch.allclose(on_rows, expected, atol=1e-5)
    # A feature half-way between two rows reads as either: the loss stays high.
    halfway = (rows[0] + rows[1]) / 2
    assert _glyph_loss(halfway.expand(1, 1, 8), targets[:, :1], rows, recipe) > 0.5


def test_glyph_accuracy_reads_features_nearest_their_characters(saved_vlm):
    _, model, processor = saved_vlm
    examples = VisualTask(style="tags").examples(4, seed=2)
    untrained = glyph_accuracy(model, processor, examples)
    assert 0.0 <= untrained < 0.5  # a random tower reads few inked cells
    tokenizer = processor.tokenizer
    rows = model.get_input_embeddings().weight.detach()
    cells = [c for ex in examples for c in ex.meta["cells"]]
    exact = rows[[tokenizer.encode(c, add_special_tokens=False)[0] for c in cells]]
    # A tower whose features are exactly the cells' embedding rows reads every inked cell.
    with patch.object(
        model,
        "get_image_features",
        return_value=SimpleNamespace(pooler_output=list(exact.view(4, 64, -1))),
    ):
        assert glyph_accuracy(model, processor, examples) == 1.0


def test_episode_accuracy_is_the_share_of_rows_greedy_decoding_gets_right(saved_vlm):
    _, _, processor = saved_vlm
    rows = _episode_rows(VisualTask(), random.Random(0), 4)
    ids, labels, _ = _sequence_batch(processor, rows)
    vocab = len(processor.tokenizer)

    def model_predicting(next_ids: torch.Tensor):
        """A stand-in model whose argmax at position t is next_ids[:, t + 1]."""
        logits = torch.nn.functional.one_hot(next_ids.roll(-1, dims=1), vocab).float()
        return lambda **_: SimpleNamespace(logits=logits)

    assert episode_accuracy(model_predicting(ids), processor, rows) == 1.0
    # One wrong model token (row 1's first answer token) fails that row only.
    wrong = ids.clone()
    first_trained = int((labels[1] != IGNORE).nonzero()[0])
    wrong[1, first_trained] = (wrong[1, first_trained] + 1) % vocab
    assert episode_accuracy(model_predicting(wrong), processor, rows) == 0.75
    # A wrong prompt or environment token (not the model's to write) changes nothing.
    other = ids.clone()
    other[2, 0] = (other[2, 0] + 1) % vocab
    env = int((labels[3] == IGNORE).nonzero()[-1])  # in the environment's reply or padding
    other[3, env] = (other[3, env] + 1) % vocab
    assert episode_accuracy(model_predicting(other), processor, rows) == 1.0


def test_direct_answer_episodes_skip_the_tool_and_a_zero_share_draws_nothing_more():
    task = VisualTask()
    plain_rng, zero_rng = random.Random(5), random.Random(5)
    plain = _episode_rows(task, plain_rng, 6)
    assert _episode_rows(task, zero_rng, 6, direct_share=0.0) == plain
    assert plain_rng.random() == zero_rng.random()  # the data order of older builds is kept
    for seed in range(5):  # the same number of direct answers in every batch
        direct = _episode_rows(task, random.Random(seed), 16, direct_share=0.7)
        assert sum(len(turns) == 1 for _, _, turns in direct) == 11
    direct = _episode_rows(task, random.Random(5), 200, direct_share=0.5)
    answers_only = [turns for _, _, turns in direct if len(turns) == 1]
    assert len(answers_only) == 100
    for (text, trained), *_ in answers_only:
        assert text.startswith("answer: ") and trained  # the total, written by the model
    assert all(len(turns) == 3 for _, _, turns in direct if len(turns) != 1)
    # Reading first, a direct answer still opens with the transcription.
    reading = VisualTask(transcribe=True)
    rows = _episode_rows(reading, random.Random(5), 16, direct_share=0.5)
    examples = reading.examples(16, seed=5)  # the rows' examples: the same first draws
    for (prompt, _, turns), ex in zip(rows, examples, strict=True):
        assert prompt == "total?\n<image>read?\n"
        first, trained = turns[0]
        assert trained and first.startswith(ex.meta["transcript"] + "\n")
        after = first.removeprefix(ex.meta["transcript"] + "\n")
        assert after == f"answer: {ex.answer}" if len(turns) == 1 else after.startswith("<python>")
    assert sum(len(turns) == 1 for _, _, turns in rows) == 8


@pytest.mark.parametrize("transcribe", [False, True])
def test_the_stop_check_asks_what_the_task_asks(transcribe):
    recipe = VisionWarmStartRecipe(task_transcribe=transcribe, stop_check_size=9)
    task = VisualTask(style=recipe.task_styles, transcribe=transcribe)
    validation = _validation_rows(task, recipe)
    assert list(validation) == ["receipt", "table", "page"]
    prompt = task.examples(1, seed=0)[0].prompt
    for rows in validation.values():
        assert len(rows) == 3  # 9 split over three styles
        for row_prompt, _, turns in rows:
            assert row_prompt == prompt  # the prompt the task trains and GRPO asks
            assert turns[0][0].startswith("<python>") != transcribe


def test_task_reading_rows_ask_read_of_the_task_images_and_end_after_the_transcript():
    task = VisualTask(style=("receipt", "table"))
    rows = _task_reading_rows(task, random.Random(2), 6)
    examples = task.examples(6, seed=2)  # the same draws
    for (prompt, image, pieces), ex in zip(rows, examples, strict=True):
        assert prompt == "<image>read?\n"
        assert image.tobytes() == ex.meta["image"].tobytes()
        assert pieces == [(ex.meta["transcript"], True)]
    assert {ex.meta["style"] for ex in examples} == {"receipt", "table"}


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("task_styles", ("receipt", "tags")),
        ("task_styles", ("menu",)),
        ("task_direct_share", 1.5),
        ("task_read_batch", -1),
        ("reading_steps", -5),
    ],
)
def test_a_recipe_with_the_held_out_style_or_a_field_out_of_range_is_refused(field, value):
    with pytest.raises(LeantrainError, match=field):
        VisionWarmStartRecipe(**{field: value})


def test_reading_rows_train_on_the_transcript_only(saved_vlm):
    _, _, processor = saved_vlm
    rng = random.Random(3)
    rows = _reading_rows(rng, 3)
    ids, labels, pixels = _sequence_batch(processor, rows)
    assert pixels.shape == (3, 3, 64, 64)
    tokenizer = processor.tokenizer
    for (prompt, _, pieces), row_ids, row_labels in zip(rows, ids, labels, strict=True):
        assert prompt == "<image>read?\n"
        trained = row_labels[row_labels != IGNORE].tolist()
        transcript_ids = tokenizer.encode(pieces[0][0], add_special_tokens=False)
        assert trained == [*transcript_ids, tokenizer.eos_token_id]
        assert row_ids.tolist().count(tokenizer.convert_tokens_to_ids("<image>")) == 64
