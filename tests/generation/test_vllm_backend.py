"""vLLM as a rollout backend, checked against the trainer and the native engine on the tiny
preset (fp32 both sides): logprobs equal a fresh trainer forward, token ids pass through
untouched, greedy output follows a weight update (or a LoRA adapter's) token for token, each
completion carries its timeline from vLLM's request stats, and a GRPO run on it trains and
writes events that tile.

Tests that need vllm skip where it is not installed, and fail where `CI` is set (`make test`
installs it there, so a skip would hide a broken install). One engine serves the module."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest
import torch
from rl_events import batch_versions, check_events

from leantrain.errors import LeantrainError
from leantrain.generation import Engine, SamplingParams, require
from leantrain.generation.backend import weights_snapshot
from leantrain.models import load_model
from leantrain.models.config import LLAMA_PROJECTIONS, LoraSettings
from leantrain.models.lora import inject_lora
from leantrain.rl.config import RLConfig
from leantrain.telemetry.events import clock

# Measured on the tiny preset in fp32 (16 sampled responses, T=0.7, on this 2-core machine):
# max 1.5e-5 to 3.9e-5 over runs, mean 7e-7. vLLM runs its own kernels (fused q/k/v and gate/up
# GEMMs, its CPU attention, picked per instruction set), so its sums round differently from
# Hugging Face's; 2e-4 is 5x the worst gap seen, room for another CPU family in CI, and still
# 50x below what a wrong temperature, position or weight version does (1e-2 and more).
LOGPROB_TOL = 2e-4


@pytest.fixture(scope="module")
def backend(tiny_path, vllm_installed):
    from leantrain.generation.vllm_backend import VLLMBackend

    vllm = VLLMBackend(tiny_path, dtype="float32", max_model_len=512, kv_cache_gib=1)
    yield vllm
    del vllm.llm


def test_logprobs_equal_a_fresh_trainer_forward_and_ids_pass_through(
    backend, policy, prompt_ids, trainer_logprobs
) -> None:
    model, tok = policy
    batch = [p for p in prompt_ids for _ in range(4)]  # prompt-major groups, as in a rollout
    params = SamplingParams(temperature=0.7, max_new_tokens=48)
    completions = backend.generate(batch, params, seed=3)
    assert len(completions) == len(batch)
    gaps = []
    for prompt, c in zip(batch, completions, strict=True):
        assert c.prompt_ids == prompt  # prompt ids preserved, in input order
        assert len(c.logprobs) == len(c.response_ids) > 0
        if c.finish_reason == "eos":
            assert c.response_ids[-1] == tok.eos_token_id
            assert tok.eos_token_id not in c.response_ids[:-1]
        else:
            assert c.finish_reason == "length" and len(c.response_ids) == params.max_new_tokens
        gaps.append(trainer_logprobs(model, prompt, c.response_ids, 0.7) - torch.tensor(c.logprobs))
    gap = torch.cat(gaps).abs()
    print(f"vLLM vs trainer logprobs (fp32): max {gap.max():.2e}, mean {gap.mean():.2e}")
    assert float(gap.max()) < LOGPROB_TOL
    # Sampling did explore: a group's responses are not all one response.
    assert len({tuple(c.response_ids) for c in completions}) > len(prompt_ids)


def test_row_i_is_sampled_with_seed_plus_i_however_the_batch_groups(backend, prompt_ids) -> None:
    params = SamplingParams(temperature=1.0, max_new_tokens=24)
    batch = [prompt_ids[0]] * 3 + [prompt_ids[1]] * 2  # groups: one request with n each
    grouped = backend.generate(batch, params, seed=100)
    alone = [backend.generate([p], params, seed=100 + i)[0] for i, p in enumerate(batch)]
    assert [c.response_ids for c in grouped] == [c.response_ids for c in alone]
    assert [c.response_ids for c in backend.generate(batch, params, seed=100)] == [
        c.response_ids for c in grouped
    ]
    other = backend.generate(batch, params, seed=200)
    assert [c.response_ids for c in other] != [c.response_ids for c in grouped]


def test_a_batch_longer_than_one_engine_step_samples_with_its_seeds(backend, prompt_ids) -> None:
    # 40 prompts of 120 tokens: more prompt tokens than vLLM's step budget on CPU (4096). With
    # chunked prefill, the seeded request cut at the budget failed (vLLM rewinds its generator,
    # which a CPU generator refuses); whole prefills sample as a batch that fits.
    long = [(p * 20)[:120] for p in prompt_ids]
    batch = [long[i % len(long)] for i in range(40)]
    params = SamplingParams(temperature=1.0, max_new_tokens=4)
    completions = backend.generate(batch, params, seed=9)
    assert all(len(c.response_ids) == 4 for c in completions)
    for i in (0, 33, 39):
        assert backend.generate([batch[i]], params, seed=9 + i)[0].response_ids == (
            completions[i].response_ids
        )


def test_greedy_with_stop_strings_equals_the_native_engine(backend, policy, prompt_ids) -> None:
    model, tok = policy
    engine = Engine(model, tok)
    for params in (
        SamplingParams(temperature=0.0, max_new_tokens=40),
        SamplingParams(temperature=0.0, max_new_tokens=40, stop=("+",)),
        SamplingParams(temperature=0.0, max_new_tokens=3),
    ):
        ours = engine.generate(prompt_ids, params)
        theirs = backend.generate(prompt_ids, params)
        for a, b in zip(ours, theirs, strict=True):
            assert b.response_ids == a.response_ids and b.finish_reason == a.finish_reason
            assert b.logprobs == pytest.approx(a.logprobs, abs=LOGPROB_TOL)
    reasons = {c.finish_reason for c in backend.generate(prompt_ids, params)}
    assert reasons == {"length"}
    stopped = backend.generate(prompt_ids, SamplingParams(temperature=0.0, stop=("+",)))
    assert {c.finish_reason for c in stopped} == {"stop"}
    assert all(tok.decode(c.response_ids).endswith("+") for c in stopped)


@pytest.fixture(scope="module")
def bpe_policy(tmp_path_factory, vllm_installed):
    """A small random Llama on SmolLM2's BPE tokenizer (multi-character tokens), saved to a
    folder, and a vLLM engine on it. Module-scoped: an engine freed while another lives takes
    vLLM's process groups down with it."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from leantrain.generation.vllm_backend import VLLMBackend
    from leantrain.models import resolve_model_path

    tok = AutoTokenizer.from_pretrained(resolve_model_path("smollm2-135m"))
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=True, initializer_range=0.3, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    folder = tmp_path_factory.mktemp("bpe-llama")
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    vllm = VLLMBackend(folder, dtype="float32", max_model_len=256, kv_cache_gib=1)
    yield model, tok, vllm
    del vllm.llm


def test_a_stop_string_ending_inside_a_token_keeps_that_token_whole_on_both_engines(
    bpe_policy,
) -> None:
    """With a BPE vocabulary a stop string can complete inside a token, or across two: both
    engines end the response with the completing token, whole (its text runs past the stop
    string), so the ids, logprobs and finish reason agree; vLLM cuts only its own text."""
    model, tok, vllm = bpe_policy
    texts = ("The quick brown fox", "def main():\n", "Once upon a time", "1, 2, 3,", "Dear Sir")
    prompts = [tok.encode(t) for t in texts]
    engine = Engine(model, tok)
    free = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=24))
    # (prompt, stop string, how many response tokens the stop keeps): for each response, its
    # first token that a stop string of two characters can end inside of, either its own
    # first two characters (inside) or the previous token's last and its first (across).
    cases: list[tuple[list[int], str, int]] = []
    for prompt, c in zip(prompts, free, strict=True):
        pieces = [tok.decode([t]) for t in c.response_ids]
        found: set[str] = set()
        for k in range(1, len(pieces)):
            if not all(p.isascii() for p in pieces[: k + 1]) or len(pieces[k]) < 3:
                continue
            before = "".join(pieces[:k])
            for kind, stop in (("inside", pieces[k][:2]), ("across", before[-1] + pieces[k][0])):
                if kind not in found and stop not in before:
                    found.add(kind)
                    cases.append((prompt, stop, k + 1))
    assert {len(s) for _, s, _ in cases} == {2} and len(cases) >= 4, cases
    for prompt, stop, kept in cases:
        params = SamplingParams(temperature=0.0, max_new_tokens=24, stop=(stop,))
        (ours,) = engine.generate([prompt], params)
        (theirs,) = vllm.generate([prompt], params)
        full = free[prompts.index(prompt)].response_ids
        assert ours.response_ids == full[:kept] and ours.finish_reason == "stop"
        assert (theirs.response_ids, theirs.finish_reason) == (ours.response_ids, "stop")
        assert theirs.logprobs == pytest.approx(ours.logprobs, abs=LOGPROB_TOL)
        text = tok.decode(theirs.response_ids)
        assert stop in text and not text.endswith(stop)  # the last token runs past it


def test_greedy_after_a_weight_update_equals_the_trainer_models(
    backend, policy, prompt_ids, tiny_path
) -> None:
    model, tok = policy
    params = SamplingParams(temperature=0.0, max_new_tokens=32)
    before = [c.response_ids for c in backend.generate(prompt_ids, params)]
    original = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(0)
    updated = {k: v + 0.05 * torch.randn_like(v) for k, v in original.items()}
    model.load_state_dict(updated)
    try:
        backend.load_weights(updated, version=7)
        assert backend.version == 7 and backend.sync_seconds[-1] > 0
        after = backend.generate(prompt_ids, params)
        expected = Engine(model, tok).generate(prompt_ids, params)
        assert [c.response_ids for c in after] == [c.response_ids for c in expected]
        assert [c.response_ids for c in after] != before  # the update did change the policy
        # vLLM's own weight-version spans: every token is labelled with the loaded version.
        assert [c.versions for c in after] == [[7] * len(c.response_ids) for c in after]
        # bf16 copies load too (cast into vLLM's fp32 parameters as they are copied).
        backend.load_weights({k: v.to(torch.bfloat16) for k, v in original.items()}, 8)
        rounded = {k: v.to(torch.bfloat16).float() for k, v in original.items()}
        model.load_state_dict(rounded)
        expected = Engine(model, tok).generate(prompt_ids, params)
        assert [c.response_ids for c in backend.generate(prompt_ids, params)] == [
            c.response_ids for c in expected
        ]
    finally:
        model.load_state_dict(original)
        backend.load_weights(original, 0)
    again = backend.generate(prompt_ids, params)
    assert [c.response_ids for c in again] == before
    assert {v for c in again for v in c.versions} == {0}


def test_each_completion_carries_its_own_timeline_inside_the_call(backend, prompt_ids) -> None:
    batch = [p for p in prompt_ids for _ in range(3)]  # groups: each row keeps its own times
    start = clock()
    completions = backend.generate(
        batch, SamplingParams(temperature=1.0, max_new_tokens=40), seed=5
    )
    end = clock()
    slack = 1e-3  # the wall clock's offset to clock() is read apart from the call
    for c in completions:
        marks = c.timeline.marks
        assert [m.phase for m in marks] == ["queue", "prefill", "decode", "done"]
        assert all(a.t <= b.t for a, b in itertools.pairwise(marks))
        assert start - slack <= marks[0].t and marks[-1].t <= end + slack
        assert [m.tokens for m in marks] == [0, 0, 1, len(c.response_ids)]
    # Rows of one group finish at their own times, not all at the last child's.
    assert len({c.timeline.marks[-1].t for c in completions}) > len(prompt_ids)


def test_what_it_cannot_do_is_refused_by_name(backend, prompt_ids) -> None:
    for capability in ("hidden_states", "images", "speculation", "kv_budget"):
        with pytest.raises(LeantrainError, match="VLLMBackend has none"):
            require(backend, capability, "a setting")
    with pytest.raises(LeantrainError, match=r"top_p"):
        backend.generate(prompt_ids, SamplingParams(top_p=0.9))
    with pytest.raises(LeantrainError, match="hidden states"):
        backend.generate(prompt_ids, SamplingParams(), return_hidden_states=True)


def test_settings_refuse_what_vllm_rollouts_cannot_run(small_rl_config: RLConfig) -> None:
    data = small_rl_config.model_dump()
    data["rollout"]["backend"] = "vllm"
    RLConfig.model_validate(data)  # the synchronous run without truncation is fine
    bad = json.loads(json.dumps(data, default=str))
    bad["sampling"]["top_p"] = 0.9
    with pytest.raises(ValueError, match=r"sampling\.top_k 0, sampling\.top_p 1"):
        RLConfig.model_validate(bad)
    # Async modes on vLLM: tests/rl/test_async_vllm.py.


def test_missing_vllm_names_the_setting_and_the_make_target(
    small_rl_config: RLConfig, policy, monkeypatch
) -> None:
    from leantrain.generation import vllm_backend
    from leantrain.rl.rollout import rollout_backend
    from leantrain.tasks import make_task

    model, tok = policy
    monkeypatch.setattr(vllm_backend, "vllm_available", lambda: False)
    cfg = small_rl_config.model_copy(deep=True)
    cfg.rollout.backend = "vllm"
    with pytest.raises(LeantrainError, match=r"rollout\.backend: vllm .* run `make vllm`"):
        rollout_backend(cfg, model, tok, make_task("arith"))
    # Tool episodes run on vLLM (tests/rl/test_episodes_vllm.py), so they need it too.
    cfg.task.name = "tool_arith"
    with pytest.raises(LeantrainError, match=r"rollout\.backend: vllm .* run `make vllm`"):
        rollout_backend(cfg, model, tok, make_task("tool_arith"))


@pytest.fixture(scope="module")
def lora_policy(tiny_path, tmp_path_factory, backend, vllm_installed):
    """The tiny model with a LoRA adapter injected, and a vLLM engine serving its adapter.
    Module-scoped, like `backend`: an engine freed in this process tears down vLLM's process
    groups, and one started after that fails, so the GRPO run's engine is the last one started."""
    from leantrain.generation.vllm_backend import VLLMBackend

    model, tok = load_model(tiny_path)
    lora = inject_lora(model, LoraSettings(r=8, alpha=16), LLAMA_PROJECTIONS)
    adapters = tmp_path_factory.mktemp("run") / "adapters"
    vllm = VLLMBackend(
        tiny_path, dtype="float32", max_model_len=512, kv_cache_gib=1, lora=lora,
        adapter_dir=adapters,
    )  # fmt: skip
    yield model, tok, vllm, adapters
    del vllm.llm


def test_a_lora_policy_publishes_its_adapter_and_vllm_follows_it(
    lora_policy, tiny_path, prompt_ids, trainer_logprobs
) -> None:
    model, tok, vllm, adapters = lora_policy
    greedy = SamplingParams(temperature=0.0, max_new_tokens=32)
    before = [c.response_ids for c in vllm.generate(prompt_ids, greedy)]
    # Updates: new adapter weights (the base stays frozen); version 2 twice, so its reused id
    # must be reloaded from disk, not served from vLLM's adapter cache.
    for seed, version in enumerate((1, 2, 2)):
        torch.manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if ".lora_" in name:
                    p.normal_(0, 0.05)
        vllm.load_weights(weights_snapshot(model), version)
        assert vllm.version == version and vllm.adapter.lora_int_id == version + 1
        folders = list(Path(vllm.adapter.lora_path).parent.iterdir())
        assert [f.name for f in folders] == [f"v{version}"]  # the old one is removed
        assert (folders[0] / "adapter_model.safetensors").is_file()
        assert Path(vllm.adapter.lora_path).is_relative_to(adapters)
        got = vllm.generate(prompt_ids, greedy)
        expected = Engine(model, tok).generate(prompt_ids, greedy)
        assert [c.response_ids for c in got] == [c.response_ids for c in expected]
        for a, b in zip(expected, got, strict=True):
            assert b.logprobs == pytest.approx(a.logprobs, abs=LOGPROB_TOL)
    assert [c.response_ids for c in got] != before  # the adapter did change the policy
    sampled = vllm.generate(prompt_ids, SamplingParams(temperature=0.7, max_new_tokens=32))
    gap = torch.cat(
        [
            trainer_logprobs(model, p, c.response_ids, 0.7) - torch.tensor(c.logprobs)
            for p, c in zip(prompt_ids, sampled, strict=True)
        ]
    ).abs()
    print(f"vLLM+LoRA vs trainer logprobs (fp32): max {gap.max():.2e}, mean {gap.mean():.2e}")
    print(f"adapter publish seconds: {vllm.sync_seconds}")
    assert float(gap.max()) < LOGPROB_TOL
    with pytest.raises(LeantrainError, match="without one"):
        vllm.load_weights(weights_snapshot(load_model(tiny_path)[0]), 3)


def test_a_lora_run_starts_vllm_with_its_adapter_settings(
    small_rl_config: RLConfig, monkeypatch
) -> None:
    from leantrain.generation import vllm_backend
    from leantrain.rl.rollout import rollout_backend
    from leantrain.tasks import make_task

    made: list[tuple] = []
    monkeypatch.setattr(vllm_backend, "vllm_available", lambda: True)
    monkeypatch.setattr(vllm_backend, "VLLMBackend", lambda *a, **kw: made.append((a, kw)))
    cfg = small_rl_config.model_copy(deep=True)
    cfg.rollout.backend = "vllm"
    cfg.lora.enabled, cfg.lora.r = True, 4
    model, tok = load_model(cfg.model.name)
    inject_lora(model, cfg.lora, cfg.lora.targets)
    model.name_or_path = "made-in-memory"  # saved under the run folder, base names only
    rollout_backend(cfg, model, tok, make_task("arith"))
    (((folder,), kw),) = made
    assert kw["lora"].r == 4 and kw["adapter_dir"] == cfg.out / "vllm-adapters"
    saved = load_model(folder)[0].state_dict()
    base = {k.replace(".base_layer.", "."): v for k, v in model.state_dict().items()}
    assert saved.keys() == {k for k in base if ".lora_" not in k}


def test_three_grpo_steps_on_vllm_train_on_policy(
    small_rl_config: RLConfig, backend, prompt_texts
) -> None:
    from leantrain.rl.grpo import GRPORun

    cfg = small_rl_config.model_copy(update={"steps": 3, "checkpoint_every": 3}, deep=True)
    assert cfg.telemetry.events  # on by default
    cfg.rollout.backend = "vllm"
    cfg.rollout.vllm_max_model_len = 512
    run = GRPORun(cfg, progress=False)
    assert type(run.source.backend).__name__ == "VLLMBackend"
    summary = run.run()
    assert summary["steps"] == 3 and summary["policy_version"] == 3
    assert run.source.backend.version == 3  # the last step's weights were published to vLLM
    records = [json.loads(line) for line in (cfg.out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        assert r["weight_sync_s"] > 0 and r["weight_sync_s"] >= r["weight_publish_s"]
        assert math.isfinite(r["loss"]) and r["grad_norm"] > 0 and 0 <= r["reward"] <= 1
        # On-policy: vLLM sampled with the weights the trainer scores, so every token's PPO
        # ratio is 1 up to the logprob gap and none is clipped.
        assert r["ratio_mean"] == pytest.approx(1.0, abs=1e-3) and r["clip_fraction"] == 0
    # After the run, vLLM holds the trained weights: its greedy output is the trainer's.
    params = SamplingParams(temperature=0.0, max_new_tokens=32)
    prompts = [run.tokenizer.encode(t) for t in prompt_texts]
    expected = Engine(run.model, run.tokenizer).generate(prompts, params)
    got = run.source.backend.generate(prompts, params)
    assert [c.response_ids for c in got] == [c.response_ids for c in expected]
    # events.jsonl: the trainer's spans tile the run, each sequence's vLLM spans tile its life
    # inside its batch's `generate` span, and batch n decodes on version n.
    events = [json.loads(line) for line in (cfg.out / "events.jsonl").read_text().splitlines()]
    batch = cfg.grpo.prompts_per_step * cfg.grpo.group_size
    seqs = check_events(events, steps=3, size=batch)
    assert {track for track, _, _ in seqs} == {"trainer"}
    assert batch_versions(seqs) == {b: {b} for b in range(3)}
    for spans in seqs.values():
        assert [s["name"] for s in spans] == ["queue", "prefill", "decode", "finish"]
