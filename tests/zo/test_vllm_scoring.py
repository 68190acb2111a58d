"""ZO on vLLM (`zo.backend: vllm`): the perturbed states scored by vLLM equal our engine's, state
by state, and three steps walk the same loss trajectory, for LoRA (adapter states batched in
one call) and all parameters (the weights published per state); fp32 on both sides, tiny model.

Tests that need vllm skip where it is not installed and fail where `CI` is set, as in
tests/generation/test_vllm_backend.py. The two engines (one serving adapters, one without LoRA)
are module-scoped: each start costs 10-20 s here.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from leantrain.errors import LeantrainError
from leantrain.models import load_model
from leantrain.settings import load_settings
from leantrain.tasks import make_task
from leantrain.zo.config import ZOConfig
from leantrain.zo.data import example_pairs, sample_batch
from leantrain.zo.engine import ZOEngine
from leantrain.zo.estimators import SPSA, OneSided
from leantrain.zo.lora import add_lora
from leantrain.zo.scoring import VLLMScorer, make_scorer

# Measured on the tiny preset in fp32 on this 2-core machine, over 3 steps x 4 states: per-state
# losses differ by at most 9.1e-8 relative with LoRA, 3.7e-7 with all parameters (vLLM's own
# kernels: fused q/k/v and gate/up, its CPU attention and LoRA ops, sums in another order).
# 1e-5 leaves room for another CPU family and is still well below the ZO signal the estimate
# resolves (|L+ - L-| / L+ is 2.8e-4 at its smallest here, with eps 1e-2).
LOSS_RTOL = 1e-5
STATES = 4  # the most adapter states one call scores


@pytest.fixture(scope="module")
def tiny(tiny_path: Path):
    model, tokenizer = load_model(tiny_path)
    pairs = example_pairs(tokenizer, make_task("sentiment").examples(64, 0))
    return model, tokenizer, pairs


def lora_copy(model):
    torch.manual_seed(0)  # LoRA's A is initialised from the global generator
    return add_lora(copy.deepcopy(model), r=8, alpha=16, targets=["q_proj", "v_proj"])


def backend_for(model, tiny_path: Path, out: Path):
    """A vLLM engine as `zo.backend: vllm` starts it for `model` (the base folder: tiny)."""
    return make_scorer(
        "vllm",
        model=model,
        folder=tiny_path,
        states=STATES,
        out=out,
        dtype="float32",
        seed=0,
        kv_cache_gib=1,
        max_model_len=512,
    ).backend


@pytest.fixture(scope="module")
def lora_backend(tiny, tiny_path, tmp_path_factory, vllm_installed):
    """A vLLM engine serving up to STATES adapters of a LoRA model built like `lora_copy`."""
    return backend_for(lora_copy(tiny[0]), tiny_path, tmp_path_factory.mktemp("zo"))


@pytest.fixture(scope="module")
def weights_backend(tiny, tiny_path, tmp_path_factory, vllm_installed):
    """A vLLM engine without LoRA: all-parameter states are published to it whole."""
    return backend_for(tiny[0], tiny_path, tmp_path_factory.mktemp("zo-all"))


def walk(engine: ZOEngine, pairs, steps: int) -> list[list[float]]:
    return [engine.step(sample_batch(pairs, 8, step)).losses for step in range(steps)]


# Four states either way: +-z for 2 directions, or the current adapter and 3 one-sided states.
@pytest.mark.parametrize("estimator", [SPSA(eps=1e-2, directions=2), OneSided(1e-2, 3)])
def test_lora_states_scored_by_vllm_equal_ours_and_walk_the_same_trajectory(
    tiny, lora_backend, estimator
) -> None:
    base, tokenizer, pairs = tiny
    pad = tokenizer.pad_token_id
    ours_model, vllm_model = lora_copy(base), lora_copy(base)
    scorer = VLLMScorer(lora_backend, vllm_model)
    ours = ZOEngine(ours_model, estimator, 1e-3, 7, pad, batched=True)
    on_vllm = ZOEngine(vllm_model, estimator, 1e-3, 7, pad, batched=True, scorer=scorer)
    expected, got = walk(ours, pairs, 3), walk(on_vllm, pairs, 3)
    flat = [(a, b) for e, g in zip(expected, got, strict=True) for a, b in zip(e, g, strict=True)]
    assert len(flat) == 3 * STATES
    gap = max(abs(a - b) / abs(a) for a, b in flat)
    signal = min(abs(e[1] - e[0]) / abs(e[0]) for e in expected)  # L+ - L- or L1 - L0
    name = type(estimator).__name__
    print(f"LoRA {name} on vLLM vs ours (fp32): max rel loss gap {gap:.1e}, signal {signal:.1e}")
    assert gap <= LOSS_RTOL and signal > 10 * gap  # the states themselves differ far more
    for a, b in zip(ours_model.parameters(), vllm_model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)  # same moves, same estimates
    # Each call dropped the previous call's adapters: vLLM holds this step's states only.
    assert len(lora_backend.llm.llm_engine.list_loras()) <= STATES


def test_all_parameter_states_published_to_vllm_equal_ours(tiny, weights_backend) -> None:
    base, tokenizer, pairs = tiny
    pad = tokenizer.pad_token_id
    ours_model = copy.deepcopy(base).requires_grad_(True)
    vllm_model = copy.deepcopy(base).requires_grad_(True)
    scorer = VLLMScorer(weights_backend, vllm_model)
    ours = ZOEngine(ours_model, SPSA(1e-3), 1e-4, 7, pad)
    on_vllm = ZOEngine(vllm_model, SPSA(1e-3), 1e-4, 7, pad, scorer=scorer)
    expected, got = walk(ours, pairs, 3), walk(on_vllm, pairs, 3)
    gap = max(
        abs(a - b) / abs(a)
        for e, g in zip(expected, got, strict=True)
        for a, b in zip(e, g, strict=True)
    )
    print(f"all-parameter ZO on vLLM vs ours (fp32): max rel loss gap {gap:.1e}")
    assert gap <= LOSS_RTOL
    for a, b in zip(ours_model.parameters(), vllm_model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_score_labels_refuses_what_the_engine_cannot_batch(tiny, lora_backend) -> None:
    backend = lora_backend
    adapter = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(1)}
    with pytest.raises(LeantrainError, match="max_loras=4"):
        backend.score_labels([[1, 2]], [[3]], [adapter] * (STATES + 1))
    with pytest.raises(LeantrainError, match="label token"):
        backend.score_labels([[]], [[3]])  # a lone token has no context to be scored in


def test_settings_name_what_the_vllm_backend_cannot_run(monkeypatch, tmp_path) -> None:
    with pytest.raises(ValueError, match=r"zo\.backend: vllm.*zo\.engine: inference"):
        load_settings(ZOConfig, None, **{"zo.backend": "vllm", "zo.engine": "reference"})
    from leantrain.generation import vllm_backend

    monkeypatch.setattr(vllm_backend, "vllm_available", lambda: False)
    with pytest.raises(LeantrainError, match=r"zo\.backend: vllm .* run `make vllm`"):
        make_scorer("vllm", model=None, folder=tmp_path, states=2, out=tmp_path, dtype="float32",
                    seed=0, kv_cache_gib=1, max_model_len=None)  # fmt: skip
    with pytest.raises(LeantrainError, match=r"unknown zo\.backend 'sglang'"):
        make_scorer("sglang")


def test_the_command_runs_on_vllm_and_names_what_it_refuses(
    tiny_path, tmp_path, vllm_installed
) -> None:
    from typer.testing import CliRunner

    from leantrain.cli import app

    small = ["-o", "task.train_size=32", "-o", "task.eval_size=16", "-o", "zo.batch_size=4"]
    args = ["zo", "--backend", "vllm", "--steps", "2", "--device", "cpu", *small]
    runner = CliRunner()
    bad = runner.invoke(app, [*args, "-o", "zo.engine=reference", "--out", str(tmp_path / "b")])
    assert bad.exit_code == 2 and "zo.backend: vllm" in bad.output
    out = tmp_path / "run"
    result = runner.invoke(app, [*args, "-o", "save=none", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "scored on vllm" in result.output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["backend"] == "vllm" and summary["steps"] == 2
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [len(r["losses"]) for r in records] == [2, 2]  # spsa, one direction: +z and -z
