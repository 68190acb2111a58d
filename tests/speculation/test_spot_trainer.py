"""The EAGLE drafter learns, and online training keeps it up with a policy that RL changed.

Acceptance length (tokens per verified row-step: accepted drafts + 1) is measured greedily with
draft length 4 on held-out `arith` prompts, so it is deterministic."""

from __future__ import annotations

import copy
import time

import pytest
import torch
from safetensors.torch import load_file

from leantrain.generation import Engine, SamplingParams
from leantrain.models import encode_prompt, load_model
from leantrain.rl.grpo import GRPORun
from leantrain.speculation.config import SpeculativeConfig
from leantrain.speculation.drafter import EagleDrafter
from leantrain.speculation.long_tail import LongTail
from leantrain.speculation.speculator import BanditSpeculator
from leantrain.speculation.spot_trainer import (
    HiddenBuffer,
    SpotTrainer,
    WarmStart,
    drafter_dir,
    ensure_drafter,
    warm_start,
)
from leantrain.tasks import ArithTask

GREEDY = SamplingParams(max_new_tokens=96, temperature=0)


@pytest.fixture(scope="module")
def tiny(tiny_path):
    return load_model(tiny_path)


@pytest.fixture(scope="module")
def warm(tiny):
    """A drafter trained for 300 steps on the tiny model's own rollouts (and its losses)."""
    model, tok = tiny
    return warm_start(
        model, tok, WarmStart(prompts=32, max_new_tokens=96, steps=300), progress=False
    )


def wait_for(condition, timeout: float = 120.0) -> None:
    """Poll until `condition()` holds (the spot trainer runs in its own thread)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting for the spot trainer"
        time.sleep(0.02)


def arith_prompts(tok, n: int, seed: int) -> list[list[int]]:
    return [encode_prompt(tok, ex.prompt) for ex in ArithTask().examples(n, seed=seed)]


def accept_len(model, tok, drafter, prompts) -> float:
    config = SpeculativeConfig(enabled=True, threshold=len(prompts), draft_lengths=[4])
    spec = BanditSpeculator(config, {"eagle": drafter})
    engine = Engine(model, tok, max_batch_size=len(prompts), speculator=spec)
    engine.generate(prompts, GREEDY)
    return spec.stats.mean_accept_len


def bound_copy(drafter: EagleDrafter, target) -> EagleDrafter:
    """`drafter`'s weights over another target (the changed policy's embedding and lm_head)."""
    bound = EagleDrafter(target, drafter.vocab)
    bound.load_state_dict(drafter.state_dict())
    return bound


def test_trained_drafter_accepts_more_than_untrained(tiny, warm):
    model, tok = tiny
    drafter, losses = warm
    assert sum(losses[-20:]) / 20 < 0.5 * sum(losses[:20]) / 20
    prompts = arith_prompts(tok, 8, seed=99)
    untrained = accept_len(model, tok, EagleDrafter(model), prompts)
    trained = accept_len(model, tok, drafter, prompts)
    assert trained > untrained + 0.5, (trained, untrained)  # measured: 2.35 vs 1.03


def test_online_drafter_beats_frozen_after_rl(tiny, warm, small_rl_config):
    _, tok = tiny
    # RL changes the policy: GRPO at a high learning rate moves it far within 6 steps.
    config = small_rl_config.model_copy(update={"steps": 6, "checkpoint_every": 6, "seed": 1})
    config.sampling = config.sampling.model_copy(update={"max_new_tokens": 96})
    config.grpo.lr, config.grpo.warmup_steps = 3e-3, 0
    run = GRPORun(config, progress=False)
    run.run()
    policy = run.model.eval()
    frozen, online = bound_copy(warm[0], policy), bound_copy(warm[0], policy)
    # The online drafter trains on the new policy's rollouts (other prompts than the test's).
    buffer = HiddenBuffer()
    rollouts = Engine(policy, tok, max_batch_size=16).generate(
        arith_prompts(tok, 32, seed=7),
        SamplingParams(max_new_tokens=96, temperature=0.7),
        seed=1,
        return_hidden_states=True,
    )
    buffer.add(0, rollouts)
    trainer = SpotTrainer(online, buffer)
    assert trainer.train_steps(100) == 100 and trainer.version == 5  # published every 20
    prompts = arith_prompts(tok, 8, seed=99)
    frozen_len, online_len = (
        accept_len(policy, tok, frozen, prompts),
        accept_len(policy, tok, online, prompts),
    )
    assert online_len > frozen_len + 0.5, (online_len, frozen_len)  # measured: 2.73 vs 1.00


def test_drafter_of_a_bf16_target_drafts_in_bf16_and_trains_in_fp32(tiny, warm):
    model, tok = tiny
    target = copy.deepcopy(model).to(torch.bfloat16)  # a bf16 rollout copy of the policy
    live = bound_copy(warm[0], target)
    assert {p.dtype for p in live.parameters()} == {torch.bfloat16}
    prompts = arith_prompts(tok, 4, seed=5)
    rollouts = Engine(target, tok).generate(prompts, GREEDY, return_hidden_states=True)
    buffer = HiddenBuffer(keep_steps=1)
    buffer.add(0, rollouts)
    trainer = SpotTrainer(live, buffer)
    assert {p.dtype for p in trainer.student.parameters()} == {torch.float32}
    before = live.fc.weight.float().clone()
    assert trainer.train_steps(20) == 20 and trainer.version == 1
    assert not torch.equal(live.fc.weight.float(), before)  # the fp32 student's update arrived
    # It still drafts tokens the bf16 target accepts (lossless whatever the drafter).
    assert accept_len(target, tok, live, prompts) > 1.5


def test_spot_trainer_thread_trains_only_when_idle_and_saves_versions(tiny, warm, tmp_path):
    model, tok = tiny
    buffer = HiddenBuffer(keep_steps=1)
    prompts = arith_prompts(tok, 8, seed=3)
    buffer.add(0, Engine(model, tok).generate(prompts, GREEDY, return_hidden_states=True))
    live = bound_copy(warm[0], model)
    trainer = SpotTrainer(live, buffer, out=tmp_path)
    trainer.start()
    try:
        time.sleep(0.3)
        assert trainer.steps == 0  # paused until told the hardware is idle
        trainer.idle(True)
        wait_for(lambda: trainer.steps >= 25)
    finally:
        trainer.stop()
    files = sorted(tmp_path.glob("drafter-v*.safetensors"))
    assert trainer.version == len(files) >= 2
    saved = load_file(files[-1])
    for name, value in live.state_dict().items():
        assert torch.equal(saved[name], value)
    assert not torch.equal(saved["fc.weight"], warm[0].state_dict()["fc.weight"])
    # Older steps leave the buffer: the drafter follows the current policy.
    buffer.add(1, [])
    buffer.add(2, [])
    assert len(buffer) == 0


def test_publish_hands_the_live_drafter_a_snapshot_through_load_weights(tiny, warm):
    # The policy's mechanism: the producer's `weights_snapshot`, the consumer's `load_weights`.
    model, tok = tiny
    buffer = HiddenBuffer(keep_steps=1)
    prompts = arith_prompts(tok, 4, seed=5)
    buffer.add(0, Engine(model, tok).generate(prompts, GREEDY, return_hidden_states=True))
    live = bound_copy(warm[0], model)
    trainer = SpotTrainer(live, buffer)
    versions = []
    load = live.load_weights
    live.load_weights = lambda weights, version: (versions.append(version), load(weights, version))
    assert trainer.train_steps(3) == 3 and trainer.publish() == 1 and versions == [1]
    for name, value in trainer.student.state_dict().items():
        assert torch.equal(live.state_dict()[name], value), name
    trainer.train_steps(1)  # the student trains on; the published copy stays as it was
    assert not torch.equal(live.fc.weight, trainer.student.fc.weight)


def test_drafter_cache_and_long_tail_metrics(tiny, tiny_path, tmp_path, monkeypatch):
    model, tok = tiny
    monkeypatch.setenv("LEANTRAIN_HOME", str(tmp_path / "home"))
    recipe = WarmStart(prompts=4, max_new_tokens=16, steps=3)
    built = ensure_drafter(tiny_path, model, tok, recipe, progress=False)
    assert (drafter_dir(tiny_path, recipe) / "build.json").exists()
    loaded = ensure_drafter(tiny_path, model, tok, recipe, progress=False)
    for (name, a), b in zip(built.state_dict().items(), loaded.state_dict().values(), strict=True):
        assert torch.equal(a.cpu(), b.cpu()), name

    config = SpeculativeConfig(enabled=True, threshold=4, train_drafter=True)
    long_tail = LongTail(config, model, tok, tiny_path, out=tmp_path / "run", progress=False)
    engine = Engine(model, tok, max_batch_size=4, speculator=long_tail.speculator)
    completions = engine.generate(
        arith_prompts(tok, 4, seed=5), GREEDY, return_hidden_states=long_tail.capture
    )
    assert all(c.hidden_states is not None for c in completions)
    long_tail.observe(0, completions)
    long_tail.idle(True)  # e.g. while the policy update runs
    wait_for(lambda: long_tail.trainer.steps >= 1)
    long_tail.close()
    metrics = long_tail.metrics()
    assert metrics["spec_accept_len"] >= 1.0 and 0 <= metrics["spec_drafted_fraction"] < 1
    assert metrics["drafter_version"] >= 1 and metrics["drafter_loss"] > 0
    assert list((tmp_path / "run" / "drafter").glob("drafter-v*.safetensors"))
