"""A LoRA policy on `vllm serve` (`rollout.backend: vllm_server` with `lora.enabled`), against one
server started here on the tiny preset in fp32 with LoRA on (`launch_server(lora=...)`): a
published adapter is what the server samples from (logprobs equal a fresh trainer forward of
the adapted policy, greedy output the native engine's on it), a new version replaces the last
(unloaded, its folder removed), GRPO runs train on it in sync and async mode with every
batch's versions exact, and a server or setting that cannot serve an adapter is refused by name.

Tests that need vllm skip where it is not installed and fail where `CI` is set, as
test_vllm_server.py's. One server serves the module (it starts in 25-40 s on 2 cores); the
non-LoRA server's refusal of a LoRA client is in test_vllm_server.py, beside its server."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from leantrain.errors import LeantrainError
from leantrain.generation import Engine, SamplingParams, require, weights_snapshot
from leantrain.models import load_model
from leantrain.models.config import LLAMA_PROJECTIONS, LoraSettings
from leantrain.models.lora import inject_lora
from leantrain.rl.config import RLConfig, RolloutConfig

pytestmark = [
    pytest.mark.slow,  # the server takes 25-40 s to start on 2 cores
    # One pytest worker runs the module (`make test`: --dist loadgroup), so its server starts once.
    pytest.mark.xdist_group("vllm-serve-lora"),
]

# The server tests' tolerance (test_vllm_server.py): the same vLLM kernels, here with its CPU
# LoRA ops on top (the in-process LoRA test holds them to the same).
LOGPROB_TOL = 2e-4
# The run config's adapter (lora.r 8 on every projection: RLConfig's defaults), so the GRPO
# runs below use this module's server.
SETTINGS = LoraSettings(r=8, alpha=16)


@pytest.fixture(scope="module")
def lora_server(tiny_path, vllm_installed, tmp_path_factory):
    from leantrain.generation.vllm_server import launch_server
    from leantrain.models.lora import lora_config

    log = tmp_path_factory.mktemp("server") / "vllm-serve.log"
    lora = lora_config(SETTINGS, LLAMA_PROJECTIONS)
    with launch_server(tiny_path, dtype="float32", max_model_len=512, log=log, lora=lora) as srv:
        yield srv


@pytest.fixture(scope="module")
def lora_policy(tiny_path):
    """The tiny preset with an adapter injected, its B weights random (peft starts them at 0,
    the base policy): (model, tokenizer, peft config)."""
    model, tok = load_model(tiny_path)
    lora = inject_lora(model, SETTINGS, LLAMA_PROJECTIONS)
    _randomize_adapter(model, seed=0)
    return model, tok, lora


def _randomize_adapter(model: torch.nn.Module, seed: int) -> None:
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.05)


@pytest.fixture(scope="module")
def backend(lora_server, lora_policy, tmp_path_factory):
    from leantrain.generation.vllm_server import VLLMServerBackend

    lora = lora_policy[2]
    weights = tmp_path_factory.mktemp("weights")
    vllm = VLLMServerBackend([lora_server.url], weights_dir=weights, lora=lora)
    yield vllm
    vllm.close()


def _adapters(url: str) -> set[str]:
    """The adapters the server holds (its /v1/models cards with a parent)."""
    import httpx

    cards = httpx.get(f"{url}/v1/models", trust_env=False).json()["data"]
    return {c["id"] for c in cards if c["parent"]}


def test_a_published_adapter_is_what_the_server_samples_from(
    lora_server, backend, lora_policy, prompt_ids, trainer_logprobs, tiny_path
) -> None:
    model, tok, _ = lora_policy
    greedy = SamplingParams(temperature=0.0, max_new_tokens=32)
    base = [c.response_ids for c in backend.generate(prompt_ids, greedy)]  # nothing published
    backend.load_weights(weights_snapshot(model), 1)
    assert backend.version == 1 and backend.adapter == "v1" and backend.sync_seconds[-1] > 0
    assert _adapters(lora_server.url) == {"v1"}
    # Only the adapter travelled: peft's two files, no base weights.
    assert sorted(f.name for f in (backend.weights_dir / "v1").iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    # Sampled at T=0.7: every token's logprob is a fresh trainer forward's of the adapted policy.
    batch = [p for p in prompt_ids for _ in range(4)]
    sampled = backend.generate(batch, SamplingParams(temperature=0.7, max_new_tokens=48), seed=5)
    assert all(c.versions == [1] * len(c.response_ids) for c in sampled)
    gap = torch.cat(
        [
            trainer_logprobs(model, p, c.response_ids, 0.7) - torch.tensor(c.logprobs)
            for p, c in zip(batch, sampled, strict=True)
        ]
    ).abs()
    print(
        f"vllm serve + LoRA vs trainer logprobs (fp32, T=0.7): max {gap.max():.2e}, "
        f"mean {gap.mean():.2e}; publish seconds {backend.sync_seconds}"
    )
    assert float(gap.max()) < LOGPROB_TOL
    # Greedy: the native engine's output on the same adapted model, token for token.
    got = backend.generate(prompt_ids, greedy)
    expected = Engine(model, tok).generate(prompt_ids, greedy)
    assert [c.response_ids for c in got] == [c.response_ids for c in expected]
    for a, b in zip(expected, got, strict=True):
        assert b.logprobs == pytest.approx(a.logprobs, abs=LOGPROB_TOL)
    assert [c.response_ids for c in got] != base  # the adapter did change the policy
    # Under an adapter, no weights in the middle of a batch: a request keeps its adapter.
    with pytest.raises(LeantrainError, match="live weights"):
        require(backend, "live_weights", "orchestrator.mode: partial")
    with pytest.raises(LeantrainError, match="cannot publish in the middle of a batch"):
        backend.load_weights_live(weights_snapshot(model), 2)
    with pytest.raises(LeantrainError, match="without one"):  # a policy without an adapter
        backend.load_weights(weights_snapshot(load_model(tiny_path)[0]), 2)


def test_a_new_version_replaces_the_last(lora_server, backend, lora_policy, prompt_ids) -> None:
    model, tok, _ = lora_policy
    greedy = SamplingParams(temperature=0.0, max_new_tokens=32)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        backend.load_weights(weights_snapshot(model), 1)
        first = [c.response_ids for c in backend.generate(prompt_ids, greedy)]
        # Version 2, then version 2 again with other weights: a republished name is read from
        # its new files (unloaded and loaded under a fresh id, its cached prefixes dropped).
        for seed in (1, 2):
            _randomize_adapter(model, seed)
            backend.load_weights(weights_snapshot(model), 2)
            assert backend.version == 2 and backend.adapter == "v2"
            assert _adapters(lora_server.url) == {"v2"}  # v1 unloaded
            assert [f.name for f in backend.weights_dir.iterdir()] == ["v2"]  # its folder gone
            got = backend.generate(prompt_ids, greedy)
            expected = Engine(model, tok).generate(prompt_ids, greedy)
            assert [c.response_ids for c in got] == [c.response_ids for c in expected]
            assert {v for c in got for v in c.versions} == {2}
        assert [c.response_ids for c in got] != first
        # The server serves the newest adapter only: the base name still answers, v1 does not.
        import httpx

        body = {"token_ids": prompt_ids[0], "sampling_params": {"max_tokens": 1}, "model": "v1"}
        answer = httpx.post(
            f"{lora_server.url}/inference/v1/generate", json=body, trust_env=False, timeout=60
        )
        assert answer.status_code == 404 and "v1" in answer.text
    finally:
        model.load_state_dict(original)


def test_a_server_of_too_low_a_rank_is_refused_by_name(lora_server, tmp_path) -> None:
    from leantrain.generation.vllm_server import VLLMServerBackend, VLLMServerError
    from leantrain.models.lora import lora_config

    lora = lora_config(LoraSettings(r=16, alpha=32), LLAMA_PROJECTIONS)
    with pytest.raises(VLLMServerError, match=r"below lora\.r 16; .*--max-lora-rank 16"):
        VLLMServerBackend([lora_server.url], weights_dir=tmp_path, lora=lora)
    lora = lora_config(SETTINGS, [*LLAMA_PROJECTIONS, "lm_head"])
    with pytest.raises(VLLMServerError, match=r"--lora-target-modules .*lm_head"):
        VLLMServerBackend([lora_server.url], weights_dir=tmp_path, lora=lora)


def _lora_config(cfg: RLConfig, url: str, **update) -> RLConfig:
    data = cfg.model_dump()
    data["rollout"] = RolloutConfig(backend="vllm_server", vllm_urls=[url]).model_dump()
    data["lora"]["enabled"] = True
    for key, value in update.items():  # `section__field` or a top-level field
        section, _, field = key.rpartition("__")
        (data[section] if section else data)[field] = value
    return RLConfig(**data)


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_two_lora_grpo_steps_on_a_vllm_server_train_on_policy(
    small_rl_config: RLConfig, lora_server, prompt_texts, assert_serves_the_trained_policy
) -> None:
    from leantrain.rl.grpo import GRPORun

    cfg = _lora_config(small_rl_config, lora_server.url, steps=2)
    cfg.checkpoint_every = 2
    run = GRPORun(cfg, progress=False)
    backend = run.source.backend
    assert type(backend).__name__ == "VLLMServerBackend" and backend.lora.r == cfg.lora.r
    assert backend.adapter == "v0"  # set-up published the (untrained) adapter
    summary = run.run()
    assert summary["steps"] == 2 and summary["policy_version"] == 2
    assert backend.version == 2 and _adapters(lora_server.url) == {"v2"}
    assert [f.name for f in (cfg.out / "vllm-server-weights").iterdir()] == ["v2"]
    records = _records(cfg.out)
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert r["weight_sync_s"] > 0 and r["weight_sync_s"] >= r["weight_publish_s"]
        assert math.isfinite(r["loss"]) and r["grad_norm"] > 0 and 0 <= r["reward"] <= 1
        # On-policy: the server sampled with the adapter the trainer scores.
        assert r["ratio_mean"] == pytest.approx(1.0, abs=1e-3) and r["clip_fraction"] == 0
    print(
        f"LoRA GRPO on vllm serve, weight_sync_s per step: {[r['weight_sync_s'] for r in records]}"
    )
    # The trained adapter moved the policy, and the server serves it: greedy is the trainer's.
    assert any(
        float(p.detach().abs().max()) > 0
        for n, p in run.model.named_parameters()
        if ".lora_B." in n
    )
    assert_serves_the_trained_policy(backend, run, prompt_texts, version=2)


def test_async_lora_grpo_on_a_vllm_server_keeps_each_batch_on_one_version(
    small_rl_config: RLConfig, lora_server
) -> None:
    """A thread worker holds the server: it loads each version's adapter between batches, and
    every token of a batch carries the batch's version (`sampled_versions` raises otherwise)."""
    import httpx

    from leantrain.rl.grpo import GRPORun

    cfg = _lora_config(
        small_rl_config,
        lora_server.url,
        steps=3,
        orchestrator__mode="async",
        orchestrator__backend="local",
        orchestrator__max_staleness=1,
    )
    cfg.checkpoint_every = 3
    summary = GRPORun(cfg, progress=False).run()
    assert summary["steps"] == 3
    records = _records(cfg.out)
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        assert math.isfinite(r["loss"]) and r["staleness_max"] <= 1
        assert r["mixed_version_trajectories"] == 0
    assert any(r["batch_worker"].startswith("worker-0.") for r in records)
    # The worker wrote its adapters into a folder of its own; after the run the trainer's
    # client put the last version (3) back on the server, the only adapter it holds.
    weights = cfg.out / "vllm-server-weights"
    assert sorted(p.name for p in weights.iterdir()) == ["v3", "worker-0"]
    assert httpx.get(f"{lora_server.url}/weight_info", trust_env=False).json() == {
        "weight_version": "3"
    }
    assert _adapters(lora_server.url) == {"v3"}


def test_partial_mode_with_lora_on_servers_is_refused_naming_the_fields(
    small_rl_config: RLConfig,
) -> None:
    with pytest.raises(LeantrainError, match=r"lora\.enabled with orchestrator\.mode: partial"):
        _lora_config(small_rl_config, "http://127.0.0.1:1", orchestrator__mode="partial")
    # Async on the in-process engine's workers: they hold no adapter.
    data = small_rl_config.model_dump()
    data["lora"]["enabled"] = True
    data["orchestrator"]["mode"] = "async"
    with pytest.raises(LeantrainError, match=r"lora\.enabled needs orchestrator\.mode: sync"):
        RLConfig(**data)
