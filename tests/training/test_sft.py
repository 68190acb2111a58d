"""The one SFT loop on a toy problem: the loss falls, each step runs at its scheduled rate and
reports the unclipped norm, a resumed run equals a straight one bit for bit, a stop ends it."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlamaForCausalLM

from leantrain.models.tiny_config import tiny_config
from leantrain.models.tokenizer import build_byte_tokenizer
from leantrain.training.sft import Checkpoints, SFTLoop, StepStats


def _model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_config(build_byte_tokenizer()))


def _batch(step: int) -> torch.Tensor:
    """Step `step`'s (4, 12) token ids: drawn from the step alone, so a resumed run sees the
    batches a straight one does."""
    return torch.randint(3, 40, (4, 12), generator=torch.Generator().manual_seed(step))


def _backward(model: LlamaForCausalLM, loop: SFTLoop) -> float:
    ids = _batch(loop.steps)
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    return float(loss.detach())


def test_the_loss_falls_at_the_scheduled_rates_and_the_model_ends_in_eval_mode() -> None:
    model = _model()
    ids = _batch(0)
    modes = []

    def backward() -> tuple[float, dict[str, float]]:
        modes.append(model.training)
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss  # one batch, memorised
        loss.backward()
        return float(loss.detach()), {"tokens": float(ids.numel())}

    loop = SFTLoop(model, lambda step: 1e-2 / (1 + step), weight_decay=0.0, max_grad_norm=0.5)
    seen: list[StepStats] = []
    history = loop.run(backward, 30, label="toy", progress=False, on_step=seen.append)
    assert seen == history and [s.step for s in history] == list(range(1, 31))
    assert history[-1].loss < 0.5 * history[0].loss
    assert [s.lr for s in history] == [1e-2 / (1 + i) for i in range(30)]
    assert loop.optimizer.param_groups[0]["lr"] == history[-1].lr
    assert history[0].grad_norm > 0.5  # the norm before clipping is what is reported
    assert all(modes) and not model.training
    assert history[0].record() == {
        "step": 1,
        "loss": history[0].loss,
        "grad_norm": history[0].grad_norm,
        "lr": 1e-2,
        "tokens": 48.0,
        "step_s": round(history[0].seconds, 4),
    }


def test_one_step_is_clip_then_adamw() -> None:
    """One step of the loop is exactly: the rate set, backward, clip to the norm, AdamW step."""
    ours, reference = _model(), _model()
    loop = SFTLoop(ours, 3e-3, weight_decay=0.01, max_grad_norm=1.0)
    stats = loop.step(lambda: _backward(ours, loop))

    optimizer = torch.optim.AdamW(reference.parameters(), lr=3e-3, weight_decay=0.01)
    ids = _batch(0)
    reference(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
    optimizer.step()
    assert stats.grad_norm == float(norm) and loop.steps == 1
    for a, b in zip(ours.parameters(), reference.parameters(), strict=True):
        assert torch.equal(a, b)
        assert a.grad is None  # zeroed (set to None) after the step


def test_a_resumed_run_equals_a_straight_one(tmp_path: Path) -> None:
    straight = _model()
    loop = SFTLoop(straight, lambda step: 1e-2 * 0.9**step, weight_decay=0.01)
    loop.run(lambda: _backward(straight, loop), 6, label="straight", progress=False)

    first = _model()
    stopped = SFTLoop(first, lambda step: 1e-2 * 0.9**step, weight_decay=0.01)
    checkpoints = Checkpoints(tmp_path / "checkpoints", every=2, keep=2)
    stopped.run(
        lambda: _backward(first, stopped),
        6,
        label="a",
        progress=False,
        checkpoints=checkpoints,
        stop=lambda stats: stats.step == 3,  # the process dies after step 3, saved at step 2
    )
    assert [p.name for p in sorted(checkpoints.root.iterdir())] == ["step-000002"]

    second = _model()  # a fresh process: initial weights, nothing trained
    resumed = SFTLoop(second, lambda step: 1e-2 * 0.9**step, weight_decay=0.01)
    assert resumed.resume(checkpoints.root) == checkpoints.root / "step-000002"
    assert resumed.steps == 2
    history = resumed.run(
        lambda: _backward(second, resumed), 6, label="b", progress=False, checkpoints=checkpoints
    )
    assert [s.step for s in history] == [3, 4, 5, 6]
    assert [p.name for p in sorted(checkpoints.root.iterdir())] == ["step-000004", "step-000006"]
    for (name, a), b in zip(straight.named_parameters(), second.parameters(), strict=True):
        assert torch.equal(a, b), name


def test_nothing_to_resume_restores_nothing(tmp_path: Path) -> None:
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    loop = SFTLoop(model, 1e-3)
    assert loop.resume(tmp_path / "checkpoints") is None and loop.steps == 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_stop_ends_the_run_and_only_given_params_train() -> None:
    model = _model()
    head = model.model.layers[-1].mlp.down_proj.weight
    frozen = model.model.layers[0].mlp.down_proj.weight.detach().clone()
    loop = SFTLoop(model, 1e-2, params=[head])
    history = loop.run(
        lambda: _backward(model, loop), 10, label="s", progress=False, stop=lambda s: s.step == 4
    )
    assert len(history) == 4 == loop.steps
    assert torch.equal(model.model.layers[0].mlp.down_proj.weight, frozen)
    assert loop.optimizer.param_groups[0]["params"] == [head]
