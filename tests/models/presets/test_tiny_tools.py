"""The `tiny-tools` preset: its warm start trains on the model's turns of worked tool episodes only,
builds deterministically, and leaves a policy that calls the tool and answers some, not all,
held-out episodes correctly (room for GRPO)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from leantrain.models import PRESETS, encode_prompt, load_model
from leantrain.models.finetune import IGNORE, completion_chunks
from leantrain.models.presets.tiny_tools import (
    ToolWarmStartRecipe,
    build_tiny_tools,
    ensure_tiny_tools,
    episode_rows,
)
from leantrain.models.tokenizer import build_byte_tokenizer
from leantrain.tasks.tool_arith import worked_turns


def test_rows_train_on_model_turns_with_the_reply_in_context_only() -> None:
    tok = build_byte_tokenizer()
    turns = worked_turns("6*7", "42")
    rows = episode_rows(tok, "calc 6*7\n", turns)
    call, reply, answer = (tok.encode(text, add_special_tokens=False) for text, _ in turns)
    prompt = tok.encode("calc 6*7\n", add_special_tokens=False)
    assert rows == [
        (prompt, call),
        (prompt + call + reply, [*answer, tok.eos_token_id]),
    ]
    # Through the shared SFT batching, the reply's tokens are never labelled.
    [(ids, labels)] = completion_chunks(rows[1:], tok.pad_token_id)
    start = len(prompt + call)
    assert (labels[0, : start + len(reply)] == IGNORE).all()
    assert labels[0, start + len(reply) :].tolist() == [*answer, tok.eos_token_id]
    assert ids[0].tolist() == prompt + call + reply + answer + [tok.eos_token_id]


def test_build_is_deterministic_for_a_seed(tiny_path: Path, tmp_path: Path) -> None:
    short = ToolWarmStartRecipe(steps=2, batch_size=4)
    build_tiny_tools(tiny_path, tmp_path / "a", short, progress=False)
    build_tiny_tools(tiny_path, tmp_path / "b", short, progress=False)
    build_tiny_tools(tiny_path, tmp_path / "c", ToolWarmStartRecipe(2, 2, 4), progress=False)
    a, b, c = (load_file(tmp_path / x / "model.safetensors") for x in "abc")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


@pytest.mark.slow
def test_preset_calls_the_tool_and_answers_some_but_not_all() -> None:
    from leantrain.generation import Engine, SamplingParams
    from leantrain.rl.episodes import EpisodeRunner

    assert "tiny-tools" in PRESETS
    ensure_tiny_tools(progress=False)
    model, tok = load_model("tiny-tools")
    task = ToolWarmStartRecipe().task()
    examples = task.examples(64, seed=1_000_003)
    episodes = EpisodeRunner(Engine(model, tok, max_batch_size=64), task).generate(
        [encode_prompt(tok, ex.prompt) for ex in examples],
        SamplingParams(max_new_tokens=64, temperature=0.0),
    )
    scores = [task.score(ex, ep.text) for ex, ep in zip(examples, episodes, strict=True)]
    mean = {part: sum(s[part] for s in scores) / len(scores) for part in task.parts}
    assert mean["format"] > 0.9 and mean["tool"] > 0.7, mean  # it knows how to use the tool
    assert 0.1 <= mean["answer"] <= 0.8, mean  # some answers right, room left for GRPO
