"""The embedded default: deterministic to build, loads like any HF folder, and is a useful start
for RL (solves some but not most held-out `arith` problems)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from leantrain.generation import Engine, SamplingParams
from leantrain.models import load_model
from leantrain.models.presets.tiny import WarmStartRecipe, build_tiny
from leantrain.tasks import ArithTask


def test_build_is_deterministic_for_a_seed(tmp_path: Path) -> None:
    short = WarmStartRecipe(steps=3, batch_size=8)
    build_tiny(tmp_path / "a", short, progress=False)
    build_tiny(tmp_path / "b", short, progress=False)
    build_tiny(tmp_path / "c", WarmStartRecipe(steps=3, batch_size=8, seed=1), progress=False)
    a, b, c = (load_file(tmp_path / x / "model.safetensors") for x in "abc")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_tiny_preset_is_a_hf_folder_of_the_right_size(tiny_path: Path) -> None:
    info = json.loads((tiny_path / "build.json").read_text())
    model, tokenizer = load_model("tiny")
    n_params = sum(p.numel() for p in model.parameters())
    assert 1_000_000 <= n_params <= 8_000_000
    assert info["parameters"] == n_params
    assert model.config.model_type == "llama"
    assert (tiny_path / "model.safetensors").exists()
    assert tokenizer.decode(tokenizer.encode("sum 3 5\n")) == "sum 3 5\n"


def test_tiny_solves_some_but_not_most(tiny_path: Path) -> None:
    model, tokenizer = load_model(tiny_path)
    task = ArithTask()
    examples = task.examples(200, seed=1_000_003)
    completions = Engine(model, tokenizer, max_batch_size=64).generate(
        [tokenizer.encode(ex.prompt) for ex in examples],
        SamplingParams(max_new_tokens=320, temperature=0.0),
    )
    solved = [
        task.score(ex, tokenizer.decode(c.response_ids, skip_special_tokens=True))
        for ex, c in zip(examples, completions, strict=True)
    ]
    accuracy = sum(s["answer"] for s in solved) / len(solved)
    assert 0.20 <= accuracy <= 0.60, accuracy  # the range: some, not most
    assert sum(s["format"] for s in solved) / len(solved) > 0.9  # it knows the format
