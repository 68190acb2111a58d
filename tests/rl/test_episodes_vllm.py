"""Multi-turn tool episodes on vLLM (`rollout.backend: vllm`), on the `tiny-tools` preset in fp32:
token ids pass through every turn unchanged (the environment's tokens exactly its encoding and
masked out of the loss), the behaviour logprobs are a fresh trainer forward's over the whole
episode, greedy episodes equal the native engine's turn by turn (the tool stop string ends a
turn on the same token), and a short GRPO run on tool episodes trains on policy.

Tests that need vllm skip where it is not installed, and fail where `CI` is set. One engine
serves the module's episode tests; the GRPO run starts its own, after them (an engine freed
while another lives takes vLLM's process groups down with it)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from leantrain.errors import LeantrainError
from leantrain.generation import Completion, Engine, SamplingParams
from leantrain.models import encode_prompt, load_model
from leantrain.models.presets.tiny_tools import ensure_tiny_tools
from leantrain.rl.config import RLConfig
from leantrain.rl.episodes import Episode, EpisodeRunner
from leantrain.settings import load_settings
from leantrain.tasks import make_task
from leantrain.tasks.tool_arith import TOOL_STOP, ToolArithTask, reply_text
from leantrain.training.logprobs import token_logprobs

# As tests/generation/test_vllm_backend.py: vLLM's kernels round differently from Hugging
# Face's (1e-5 to 4e-5 seen in fp32); a wrong position, context or temperature is 1e-2 and more.
LOGPROB_TOL = 2e-4

# configs/tiny-tools.yaml's task: what the preset was warm-started on.
TASK = {"min_digits": 1, "max_digits": 2, "max_terms": 2, "max_turns": 3, "episode_tokens": 160}


class Recorded:
    """A backend that keeps every turn's prompts and completions, in call order."""

    def __init__(self, backend) -> None:
        self.backend = backend
        self.capabilities = backend.capabilities
        self.calls: list[tuple[list[list[int]], list[Completion]]] = []

    def generate(self, prompts, params, *, seed=None, **options):
        out = self.backend.generate(prompts, params, seed=seed, **options)
        self.calls.append(([list(p) for p in prompts], out))
        return out

    def load_weights(self, weights, version):
        self.backend.load_weights(weights, version)


@pytest.fixture(scope="module")
def policy():
    return load_model(ensure_tiny_tools(progress=False))


@pytest.fixture(scope="module")
def vllm(vllm_installed):
    from leantrain.generation.vllm_backend import VLLMBackend

    backend = VLLMBackend(
        ensure_tiny_tools(progress=False), dtype="float32", max_model_len=512, kv_cache_gib=1
    )
    yield backend
    del backend.llm


@pytest.fixture(scope="module")
def task() -> ToolArithTask:
    return make_task("tool_arith", **TASK)


@pytest.fixture(scope="module")
def prompts(policy, task):
    _, tok = policy
    return [encode_prompt(tok, ex.prompt) for ex in task.examples(8, seed=11)]


def run_episodes(backend, task, tok, prompts, params, seed=None, max_context=None):
    recorded = Recorded(backend)
    runner = EpisodeRunner(recorded, task, tok, max_context=max_context)
    return runner.generate(prompts, params, seed=seed), recorded.calls


def check_token_identity(ep: Episode, prompt: list[int], calls, tok) -> None:
    """Walk one episode's row: each model turn is exactly the ids the backend returned for the
    context so far (itself exactly the row up to there), each tool reply exactly its encoding."""
    assert ep.prompt_ids == prompt and len(ep.segments) == 1  # no chat template: no fork
    row = ep.segments[0]
    assert row.prompt_ids == prompt and row.response_ids == ep.response_ids
    at = 0
    for turn in range(ep.turns):
        prompts_sent, completions = calls[turn]
        context = prompt + ep.response_ids[:at]
        (c,) = [c for p, c in zip(prompts_sent, completions, strict=True) if p == context]
        kept = ep.response_ids[at : at + len(c.response_ids)]
        assert kept == c.response_ids[: len(kept)]  # cut only by the episode's token budget
        assert ep.logprobs[at : at + len(kept)] == c.logprobs[: len(kept)]
        assert ep.loss_mask[at : at + len(kept)] == [1] * len(kept)
        at += len(kept)
        if turn < len(ep.tool_calls):
            # The turn ended on the tool stop string, its completing token kept.
            assert c.finish_reason == "stop" and tok.decode(c.response_ids).endswith(TOOL_STOP)
            reply = tok.encode(reply_text(ep.tool_calls[turn].output), add_special_tokens=False)
            assert ep.response_ids[at : at + len(reply)] == reply
            assert ep.loss_mask[at : at + len(reply)] == [0] * len(reply)
            assert ep.logprobs[at : at + len(reply)] == [0.0] * len(reply)
            at += len(reply)
    assert at == len(ep.response_ids)


def test_episode_token_ids_pass_through_vllm_unchanged_and_env_tokens_are_masked(
    vllm, policy, task, prompts
) -> None:
    model, tok = policy
    params = SamplingParams(max_new_tokens=64, temperature=0.7)
    episodes, calls = run_episodes(
        vllm, task, tok, prompts, params, seed=4, max_context=vllm.max_model_len
    )
    assert sum(len(ep.tool_calls) for ep in episodes) >= len(prompts) // 2  # it uses the tool
    assert sum(ep.env_tokens for ep in episodes) > 0
    gaps = []
    for prompt, ep in zip(prompts, episodes, strict=True):
        check_token_identity(ep, prompt, calls, tok)
        # The behaviour logprobs of the model's tokens are the trainer's, on one forward over
        # the whole episode: vLLM saw exactly the context the trainer scores.
        with torch.no_grad():
            logits = model(torch.tensor([prompt + ep.response_ids])).logits[0, len(prompt) - 1 : -1]
        trainer = token_logprobs(logits, torch.tensor(ep.response_ids), 0.7)
        model_tokens = torch.tensor(ep.loss_mask, dtype=torch.bool)
        gaps.append((trainer - torch.tensor(ep.logprobs))[model_tokens])
    gap = torch.cat(gaps).abs()
    print(f"vLLM episodes vs trainer logprobs (fp32): max {gap.max():.2e}, mean {gap.mean():.2e}")
    assert float(gap.max()) < LOGPROB_TOL
    # The same seed gives the same episodes (each turn's rows are seeded from it).
    again, _ = run_episodes(vllm, task, tok, prompts, params, seed=4, max_context=512)
    assert [ep.response_ids for ep in again] == [ep.response_ids for ep in episodes]


def test_greedy_episodes_on_vllm_equal_the_native_engines_turn_by_turn(
    vllm, policy, task, prompts
) -> None:
    model, tok = policy
    params = SamplingParams(max_new_tokens=64, temperature=0.0)
    ours, native_calls = run_episodes(Engine(model, tok), task, tok, prompts, params)
    theirs, vllm_calls = run_episodes(vllm, task, tok, prompts, params)
    assert len(vllm_calls) == len(native_calls) >= 2  # at least one tool round
    for (sent_a, out_a), (sent_b, out_b) in zip(native_calls, vllm_calls, strict=True):
        assert sent_b == sent_a  # the same contexts went in, as ids
        for a, b in zip(out_a, out_b, strict=True):
            assert (b.response_ids, b.finish_reason) == (a.response_ids, a.finish_reason)
            assert b.logprobs == pytest.approx(a.logprobs, abs=LOGPROB_TOL)
    for a, b in zip(ours, theirs, strict=True):
        assert (b.response_ids, b.loss_mask, b.finish_reason) == (
            a.response_ids,
            a.loss_mask,
            a.finish_reason,
        )
        assert [c.output for c in b.tool_calls] == [c.output for c in a.tool_calls]
        assert b.text == a.text
    assert {ep.finish_reason for ep in theirs} <= {"eos", "length", "max_turns", "budget"}
    assert any(ep.tool_calls and ep.finish_reason == "eos" for ep in theirs)


def test_an_episode_longer_than_vllms_context_is_refused_before_it_starts(
    vllm, policy, task, prompts
) -> None:
    _, tok = policy
    with pytest.raises(LeantrainError, match="needs the policy's tokenizer"):
        EpisodeRunner(vllm, task)  # vLLM's own tokenizer is not the one episodes encode with
    runner = EpisodeRunner(vllm, task, tok, max_context=len(prompts[0]) + 100)
    with pytest.raises(LeantrainError, match=r"episode_tokens \(160\) exceeds .* max_model_len"):
        runner.generate(prompts[:1], SamplingParams(max_new_tokens=8))


def test_three_grpo_steps_on_tool_episodes_on_vllm_train_on_policy(
    tmp_path, vllm_installed
) -> None:
    from leantrain.generation.vllm_backend import VLLMBackend
    from leantrain.rl.grpo import GRPORun

    cfg = load_settings(
        RLConfig,
        "configs/tiny-tools.yaml",
        **{
            "steps": 3,
            "out": tmp_path / "run",
            "device": "cpu",
            "task.eval_size": 4,
            "task.options.episode_tokens": 96,
            "sampling.max_new_tokens": 32,
            "grpo.prompts_per_step": 4,
            "grpo.group_size": 4,
            "checkpoint_every": 3,
            "rollout.backend": "vllm",
            "rollout.vllm_max_model_len": 256,
        },
    )
    run = GRPORun(cfg, progress=False)
    assert isinstance(run.source.backend, EpisodeRunner)
    assert isinstance(run.source.backend.engine, VLLMBackend)
    summary = run.run()
    assert summary["steps"] == 3 and summary["policy_version"] == 3
    assert run.source.backend.engine.version == 3  # every step's weights reached vLLM
    records = [json.loads(line) for line in (cfg.out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert sum(r["env_tokens"] for r in records) > 0
    assert any(r["grad_norm"] > 0 for r in records)  # some group's rewards differed: it trained
    for r in records:
        assert r["weight_sync_s"] > 0
        assert r["active_tokens"] == r["generated_tokens"]  # env tokens are not trained on
        assert math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"])
        # On-policy through the episodes: vLLM's logprobs of the model's tokens, with the
        # environment's tokens in their context, are what the trainer recomputes.
        assert r["ratio_mean"] == pytest.approx(1.0, abs=1e-3) and r["clip_fraction"] == 0


def test_vision_tool_episodes_are_refused_on_vllm_before_it_starts(tmp_path) -> None:
    from leantrain.rl.grpo import GRPORun

    cfg = load_settings(
        RLConfig,
        "configs/tiny-vl-tools.yaml",
        **{"out": tmp_path / "run", "device": "cpu", "rollout.backend": "vllm"},
    )
    with pytest.raises(LeantrainError, match=r"image prompts: rollout\.backend: vllm takes no"):
        GRPORun(cfg, progress=False)
