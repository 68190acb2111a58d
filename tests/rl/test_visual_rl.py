"""GRPO on a vision-language model: trajectories carry their images, packed rows with images give
the logprobs separate forwards give, a run with the `visual` task trains (vision tower frozen or
not) and writes its report page. The model is an untrained tiny VLM saved to a tmp folder."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from leantrain.errors import LeantrainError
from leantrain.generation import Engine, SamplingParams
from leantrain.models.presets.tiny_vl import tiny_vl_model
from leantrain.models.vision import encode_image_prompt
from leantrain.rl.config import RLConfig
from leantrain.rl.grpo import GRPORun
from leantrain.rl.packing import pack, packed_logprobs
from leantrain.rl.trajectory import Trajectory
from leantrain.settings import load_settings
from leantrain.tasks.visual import VisualTask


@pytest.fixture(scope="module")
def vlm_dir(tiny_path, tmp_path_factory):
    model, processor = tiny_vl_model(tiny_path)
    with torch.no_grad():  # an untrained projector yields near-zero features; make images matter
        for p in model.model.multi_modal_projector.parameters():
            p.mul_(20.0)
    folder = tmp_path_factory.mktemp("tiny-vl-untrained")
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


def _config(vlm_dir, out, **overrides):
    settings = {
        "model.name": str(vlm_dir),
        "task.name": "visual",
        "task.options": {"episode_tokens": 24, "max_turns": 2, "timeout_s": 1.0},
        "task.eval_size": 2,
        "sampling.max_new_tokens": 12,
        "grpo.prompts_per_step": 2,
        "grpo.group_size": 2,
        "grpo.lr": 1e-2,
        "grpo.warmup_steps": 0,
        "steps": 1,
        "device": "cpu",
        "out": out,
        "checkpoint_every": 1,
    }
    return load_settings(RLConfig, None, **{**settings, **overrides})


def test_packed_rows_with_images_match_separate_forwards(vlm_dir):
    from leantrain.models import load_model
    from leantrain.models.vision import load_processor

    model, tokenizer = load_model(vlm_dir)
    processor = load_processor(vlm_dir)
    examples = VisualTask().examples(2, seed=4)
    encoded = [encode_image_prompt(processor, ex.prompt, [ex.meta["image"]]) for ex in examples]
    text = tokenizer.encode("calc 3+4\n", add_special_tokens=False)
    prompts, images = [*(ids for ids, _ in encoded), text], [*(pv for _, pv in encoded), None]
    completions = Engine(model, tokenizer).generate(
        prompts, SamplingParams(max_new_tokens=8, temperature=1.0), seed=1, images=images
    )
    rows = [
        Trajectory(
            prompt_ids=c.prompt_ids,
            response_ids=c.response_ids,
            logprobs=c.logprobs,
            versions=[0] * len(c.response_ids),
            loss_mask=[1] * len(c.response_ids),
            finish_reason=c.finish_reason,
            pixel_values=pv,
        )
        for c, pv in zip(completions, images, strict=True)
    ]
    # Image rows first and last around a text row: their images must stay in row order.
    order = [0, 2, 1]
    batch = pack([rows[i] for i in order], torch.zeros(3))
    assert batch.pixel_values.shape[0] == 2
    with torch.no_grad():
        packed = packed_logprobs(model, batch)
        separate = torch.cat(
            [packed_logprobs(model, pack([rows[i]], torch.zeros(1))) for i in order]
        )
    assert torch.allclose(packed, separate, atol=1e-4)
    # ... and they are the rollout's own logprobs (temperature 1).
    assert torch.allclose(packed, batch.old_logprobs, atol=1e-4)


@pytest.mark.parametrize("freeze_vision", [False, True])
def test_grpo_step_with_images_trains_and_writes_the_report(vlm_dir, tmp_path, freeze_vision):
    config = _config(vlm_dir, tmp_path / "run", **{"model.freeze_vision": freeze_vision})
    run = GRPORun(config, progress=False)
    summary = run.run()  # one rollout + train step end to end, the report page included
    assert summary["steps"] == 1
    page = (tmp_path / "run" / "report.html").read_text()
    assert page.count("data:image/png;base64,") == 2  # one row per prompt of the step
    assert "total?" in page
    record = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert {"reward_format", "reward_answer", "reward_tool"} <= set(record)

    # An untrained policy earns no reward, so give the step's responses distinct rewards to
    # get a gradient, and check what moved.
    trajectories = run.source.rollout(run.step, run.version)
    assert all(t.pixel_values is not None and t.pixel_values.shape[0] == 1 for t in trajectories)
    scored = [replace(t, reward=float(i % 2)) for i, t in enumerate(trajectories)]
    tower = run.model.model.vision_tower
    projector = run.model.model.multi_modal_projector
    before = {
        "tower": [p.detach().clone() for p in tower.parameters()],
        "projector": [p.detach().clone() for p in projector.parameters()],
    }
    stats = run.learner.step(scored)
    assert stats["skipped"] == 0.0
    moved = {
        name: any(not torch.equal(a, b) for a, b in zip(old, module.parameters(), strict=True))
        for (name, old), module in zip(before.items(), (tower, projector), strict=True)
    }
    assert moved == {"tower": not freeze_vision, "projector": True}


def test_image_tasks_need_a_vision_model_and_sync_mode(vlm_dir, tiny_path, tmp_path):
    with pytest.raises(LeantrainError, match="text-only"):
        GRPORun(_config(vlm_dir, tmp_path / "a", **{"model.name": str(tiny_path)}))
    with pytest.raises(LeantrainError, match="freeze_vision"):
        GRPORun(
            _config(
                vlm_dir,
                tmp_path / "b",
                **{"model.name": str(tiny_path), "model.freeze_vision": True},
            )
        )


def test_the_shipped_config_builds_its_task():
    from pathlib import Path

    from leantrain.tasks import make_task

    config = load_settings(RLConfig, Path(__file__).parents[2] / "configs" / "tiny-vl-tools.yaml")
    task = make_task(config.task.name, **config.task.options)
    assert isinstance(task, VisualTask) and task.styles == ("receipt", "table", "page")
    assert task.transcribe and "tags" not in task.styles  # reads first; tags stay held out
    assert config.model.name == "tiny-vl"
    # A transcription before the call must fit the turn and the episode.
    ex = task.examples(1, seed=0)[0]
    assert len(ex.solution) < min(config.sampling.max_new_tokens, task.episode_tokens)
