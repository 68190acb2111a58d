"""vLLM over HTTP as a rollout backend, against one `vllm serve` started here on the tiny preset
in fp32 (`launch_server`): logprobs equal a fresh trainer forward, row i is sampled with seed
base + i as on the in-process backend (the same samples), greedy output follows a published
weight update token for token with every token labelled with the new version, greedy tool
episodes equal the native engine's, a GRPO run on it trains on-policy, and bad settings or
servers are refused at set-up by name.

Tests that need vllm skip where it is not installed and fail where `CI` is set, as
test_vllm_backend.py's. One server serves the module (it starts in 25-40 s on 2 cores)."""

from __future__ import annotations

import json
import math
import time

import pytest
import torch

from leantrain.errors import LeantrainError
from leantrain.generation import Engine, SamplingParams, require
from leantrain.models import load_model
from leantrain.rl.config import RLConfig, RolloutConfig

pytestmark = [
    pytest.mark.slow,  # the server takes 25-40 s to start on 2 cores
    # One pytest worker runs the module (`make test`: --dist loadgroup), so its server starts once.
    pytest.mark.xdist_group("vllm-serve"),
]

# The in-process backend's tolerance (test_vllm_backend.py, where the measured gaps are): the
# server runs the same vLLM kernels on the same weights. Measured here over HTTP (16 responses,
# T=0.7): see the printed gap.
LOGPROB_TOL = 2e-4


@pytest.fixture(scope="module")
def server(tiny_path, vllm_installed, tmp_path_factory):
    from leantrain.generation.vllm_server import launch_server

    log = tmp_path_factory.mktemp("server") / "vllm-serve.log"
    with launch_server(tiny_path, dtype="float32", max_model_len=512, log=log) as srv:
        yield srv


@pytest.fixture(scope="module")
def backend(server, tmp_path_factory):
    from leantrain.generation.vllm_server import VLLMServerBackend

    vllm = VLLMServerBackend([server.url], weights_dir=tmp_path_factory.mktemp("weights"))
    yield vllm
    vllm.close()


def test_logprobs_equal_a_fresh_trainer_forward_and_ids_pass_through(
    backend, policy, prompt_ids, trainer_logprobs
) -> None:
    model, tok = policy
    assert backend.max_model_len == 512
    batch = [p for p in prompt_ids for _ in range(4)]  # prompt-major groups, as in a rollout
    params = SamplingParams(temperature=0.7, max_new_tokens=48)
    completions = backend.generate(batch, params, seed=3)
    assert len(completions) == len(batch)
    gaps = []
    for prompt, c in zip(batch, completions, strict=True):
        assert c.prompt_ids == prompt  # prompt ids preserved, in input order
        assert len(c.logprobs) == len(c.response_ids) > 0
        assert c.versions == [0] * len(c.response_ids)  # set-up labels the weights 0
        if c.finish_reason == "eos":
            assert c.response_ids[-1] == tok.eos_token_id
            assert tok.eos_token_id not in c.response_ids[:-1]
        else:
            assert c.finish_reason == "length" and len(c.response_ids) == params.max_new_tokens
        gaps.append(trainer_logprobs(model, prompt, c.response_ids, 0.7) - torch.tensor(c.logprobs))
    gap = torch.cat(gaps).abs()
    print(
        f"vllm serve vs trainer logprobs (fp32, T=0.7): max {gap.max():.2e}, mean {gap.mean():.2e}"
    )
    assert float(gap.max()) < LOGPROB_TOL
    # At T=0.7 the processed logprobs are log_softmax(logits / 0.7), not T=1's: a server without
    # --logprobs-mode processed_logprobs would be this far off.
    t1 = torch.cat(
        [
            trainer_logprobs(model, p, c.response_ids, 1.0) - torch.tensor(c.logprobs)
            for p, c in zip(batch, completions, strict=True)
        ]
    ).abs()
    assert float(t1.max()) > 100 * LOGPROB_TOL
    # Sampling did explore: a group's responses are not all one response.
    assert len({tuple(c.response_ids) for c in completions}) > len(prompt_ids)


def test_row_i_is_sampled_with_seed_plus_i_however_the_batch_groups(backend, prompt_ids) -> None:
    params = SamplingParams(temperature=1.0, max_new_tokens=24)
    batch = [prompt_ids[0]] * 3 + [prompt_ids[1]] * 2  # two groups: two requests with n 3, 2
    grouped = backend.generate(batch, params, seed=100)
    alone = [backend.generate([p], params, seed=100 + i)[0] for i, p in enumerate(batch)]
    assert [c.response_ids for c in grouped] == [c.response_ids for c in alone]
    assert [c.logprobs for c in grouped] == [c.logprobs for c in alone]
    other = backend.generate(batch, params, seed=200)
    assert [c.response_ids for c in other] != [c.response_ids for c in grouped]


def test_two_urls_spread_the_groups_and_keep_the_input_order(
    server, backend, prompt_ids, tmp_path
) -> None:
    """Two URLs (the one server under two names, so the samples must agree): the groups go
    to them in turn, concurrently, and come back in input order."""
    from leantrain.generation.vllm_server import VLLMServerBackend

    other = server.url.replace("127.0.0.1", "localhost")
    two = VLLMServerBackend([server.url, other + "/"], weights_dir=tmp_path)
    assert two.urls == [server.url, other]
    batch = [p for p in prompt_ids for _ in range(3)]
    params = SamplingParams(temperature=1.0, max_new_tokens=24)
    got = two.generate(batch, params, seed=11)
    want = backend.generate(batch, params, seed=11)
    assert [c.prompt_ids for c in got] == batch
    assert [c.response_ids for c in got] == [c.response_ids for c in want]
    two.close()


def test_the_same_seeds_give_the_in_process_backends_samples(
    backend, tiny_path, prompt_ids
) -> None:
    """The server and an in-process `vllm.LLM` on the same folder: one seed convention, the
    same token ids; the logprobs within the tolerance."""
    from leantrain.generation.vllm_backend import VLLMBackend

    batch = [p for p in prompt_ids for _ in range(4)]
    params = SamplingParams(temperature=0.7, max_new_tokens=32)
    local = VLLMBackend(tiny_path, dtype="float32", max_model_len=512, kv_cache_gib=1)
    try:
        theirs = local.generate(batch, params, seed=21)
    finally:
        del local.llm
    ours = backend.generate(batch, params, seed=21)
    assert [c.response_ids for c in ours] == [c.response_ids for c in theirs]
    assert [c.finish_reason for c in ours] == [c.finish_reason for c in theirs]
    gap = max(
        abs(a - b)
        for x, y in zip(ours, theirs, strict=True)
        for a, b in zip(x.logprobs, y.logprobs, strict=True)
    )
    print(f"vllm serve vs in-process vLLM logprobs: max {gap:.2e}")
    assert gap < LOGPROB_TOL


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
    stopped = backend.generate(prompt_ids, SamplingParams(temperature=0.0, stop=("+",)))
    assert {c.finish_reason for c in stopped} == {"stop"}
    assert all(tok.decode(c.response_ids).endswith("+") for c in stopped)


def test_greedy_after_a_weight_update_equals_the_trainer_models(
    backend, policy, prompt_ids
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
        assert [f.name for f in backend.weights_dir.iterdir()] == ["v7"]
        after = backend.generate(prompt_ids, params)
        expected = Engine(model, tok).generate(prompt_ids, params)
        assert [c.response_ids for c in after] == [c.response_ids for c in expected]
        assert [c.response_ids for c in after] != before  # the update did change the policy
        # vLLM's own weight-version spans: every token is labelled with the loaded version.
        assert [c.versions for c in after] == [[7] * len(c.response_ids) for c in after]
        # A plain state_dict (tied embeddings share memory) and bf16 copies publish too; the
        # previous version's folder goes.
        model.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in original.items()})
        backend.load_weights({k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}, 8)
        assert [f.name for f in backend.weights_dir.iterdir()] == ["v8"]
        expected = Engine(model, tok).generate(prompt_ids, params)
        assert [c.response_ids for c in backend.generate(prompt_ids, params)] == [
            c.response_ids for c in expected
        ]
    finally:
        model.load_state_dict(original)
        backend.load_weights(original, 0)
    print(f"publish seconds (tiny, 1 server): {[round(s, 3) for s in backend.sync_seconds]}")
    again = backend.generate(prompt_ids, params)
    assert [c.response_ids for c in again] == before
    assert {v for c in again for v in c.versions} == {0}


def _generated_tokens(url: str) -> float:
    """The server's count of tokens generated so far (its Prometheus `/metrics`)."""
    import httpx

    text = httpx.get(f"{url}/metrics", trust_env=False).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:generation_tokens_total")
    )


def test_a_live_update_switches_running_sequences_to_the_new_version_exactly(
    server, backend, policy, prompt_ids, trainer_logprobs
) -> None:
    """`load_weights_live` while a batch decodes (partial rollouts): sequences running at the
    update carry version 0 then version 1 inside one response, and every token's logprob is a
    fresh trainer forward's of the version its span names: the kept requests were preempted
    and recomputed on the new weights, not decoded on over the old weights' KV."""
    import threading

    model, _ = policy
    original = {k: v.clone() for k, v in model.state_dict().items()}
    # Version 0 nearly uniform (a near-zero final norm: small logits), so responses run long
    # (EOS about 1 in 259) and the update lands while they decode; version 1 the preset's.
    # The race is the test's: on a quiet machine the tiny model decodes a batch in well under
    # a second, so an update that lands after the batch is tried again on a fresh one.
    flat = {**original, "model.norm.weight": original["model.norm.weight"] * 0.05}
    batch = [p for p in prompt_ids for _ in range(4)]
    params = SamplingParams(temperature=1.0, max_new_tokens=256)
    for attempts in range(1, 6):  # noqa: B007 (reported below)
        backend.load_weights(flat, 0)
        out: list = []
        try:
            before = _generated_tokens(server.url)
            decoding = threading.Thread(
                target=lambda out=out: out.append(backend.generate(batch, params))
            )
            decoding.start()
            deadline = time.monotonic() + 60
            while _generated_tokens(server.url) < before + len(batch):
                assert time.monotonic() < deadline and decoding.is_alive(), "the batch never ran"
                time.sleep(0.005)
            t0 = time.perf_counter()
            backend.load_weights_live(original, 1)
            live_s = time.perf_counter() - t0
            decoding.join()
        finally:
            backend.load_weights(original, 0)
        (completions,) = out
        mixed = [c for c in completions if set(c.versions) == {0, 1}]
        if mixed:
            break
    gaps = {0: 0.0, 1: 0.0}
    for c in completions:
        assert c.versions == sorted(c.versions) and set(c.versions) <= {0, 1}
        for version, weights in ((0, flat), (1, original)):
            at = [i for i, v in enumerate(c.versions) if v == version]
            if not at:
                continue
            model.load_state_dict(weights)
            lp = trainer_logprobs(model, c.prompt_ids, c.response_ids, 1.0)
            gaps[version] = max(
                gaps[version], float((lp[at] - torch.tensor(c.logprobs)[at]).abs().max())
            )
    model.load_state_dict(original)
    print(
        f"live update (attempt {attempts}): {live_s:.3f} s, {len(mixed)} of {len(batch)} "
        f"responses switched versions inside, logprob gap per version {gaps}"
    )
    assert mixed, [(c.versions.count(0), c.versions.count(1)) for c in completions]
    assert max(gaps.values()) < LOGPROB_TOL


def test_what_it_cannot_do_is_refused_by_name(backend, prompt_ids) -> None:
    for capability in ("hidden_states", "images", "speculation", "kv_budget"):
        with pytest.raises(LeantrainError, match="VLLMServerBackend has none"):
            require(backend, capability, "a setting")
    with pytest.raises(LeantrainError, match=r"top_p"):
        backend.generate(prompt_ids, SamplingParams(top_p=0.9))
    with pytest.raises(LeantrainError, match="hidden states"):
        backend.generate(prompt_ids, SamplingParams(), return_hidden_states=True)


def test_settings_and_servers_that_cannot_work_are_refused_at_set_up(
    small_rl_config: RLConfig, server, tmp_path
) -> None:
    from leantrain.generation.vllm_server import VLLMServerBackend, VLLMServerError, free_port
    from leantrain.rl.rollout import refuse_unsupported
    from leantrain.tasks import make_task

    with pytest.raises(LeantrainError, match=r"rollout\.vllm_urls|vllm_urls"):
        RolloutConfig(backend="vllm_server")
    with pytest.raises(LeantrainError, match=r"'ftp://x:1' is not an http\(s\) URL"):
        RolloutConfig(backend="vllm_server", vllm_urls=["ftp://x:1"])
    ok = RolloutConfig(backend="vllm_server", vllm_urls=["http://10.0.0.5:8000/"])
    assert ok.vllm_urls == ["http://10.0.0.5:8000"]
    # Nothing listens there: refused within the connect timeout, naming the URL.
    dead = f"http://127.0.0.1:{free_port()}"
    t0 = time.perf_counter()
    with pytest.raises(VLLMServerError, match=rf"{dead}/health: cannot reach the server"):
        VLLMServerBackend([dead], weights_dir=tmp_path, connect_timeout_s=2)
    assert time.perf_counter() - t0 < 5
    # A URL that is a server, but not a vLLM root: its routes are not there.
    with pytest.raises(VLLMServerError, match=r"/nothing/health answered HTTP 404"):
        VLLMServerBackend([server.url + "/nothing"], weights_dir=tmp_path)
    # A LoRA policy's client on a server started without LoRA (no adapter routes): refused at
    # set-up, naming what to start it with (test_vllm_server_lora.py serves one).
    from leantrain.models.config import LLAMA_PROJECTIONS, LoraSettings
    from leantrain.models.lora import lora_config

    lora = lora_config(LoraSettings(r=8, alpha=16), LLAMA_PROJECTIONS)
    with pytest.raises(
        VLLMServerError,
        match=r"/v1/load_lora_adapter answered HTTP 404; .*--enable-lora .*"
        r"VLLM_ALLOW_RUNTIME_LORA_UPDATING=True",
    ):
        VLLMServerBackend([server.url], weights_dir=tmp_path, lora=lora)
    # The run's own check of a LoRA run on servers passes: it is built.
    task = make_task("arith")
    data = small_rl_config.model_dump()
    data["rollout"].update(backend="vllm_server", vllm_urls=[server.url])
    data["lora"]["enabled"] = True
    refuse_unsupported(RLConfig.model_validate(data), task, task.examples(1, 0)[0])


def test_launch_failure_names_the_folder_and_shows_the_servers_log(
    tmp_path, vllm_installed
) -> None:
    from leantrain.generation.vllm_server import VLLMServerError, launch_server

    (tmp_path / "config.json").write_text("{}")  # a folder vLLM cannot serve
    with pytest.raises(VLLMServerError, match=r"exited with code \d+ .* last lines") as e:
        launch_server(tmp_path, timeout_s=120, log=tmp_path / "log")
    assert str(tmp_path) in str(e.value)


def test_greedy_tool_episodes_on_a_server_equal_the_native_engines(backend, policy) -> None:
    """Tool episodes on the server (an `EpisodeRunner` around it, as a run on tool tasks builds
    it): the tiny-tools preset's weights, published into the tiny server (one architecture and
    tokenizer), call the tool and end each turn on its stop string as the native engine does."""
    from leantrain.generation.backend import weights_snapshot
    from leantrain.models import encode_prompt
    from leantrain.models.presets.tiny_tools import ensure_tiny_tools
    from leantrain.rl.episodes import EpisodeRunner
    from leantrain.tasks import make_task

    model, tok = load_model(ensure_tiny_tools(progress=False))
    # The server matches stop strings in text from the tokenizer it was started with.
    assert tok.get_vocab() == policy[1].get_vocab()
    backend.load_weights(weights_snapshot(model), 1)  # the GRPO run below publishes its own
    task = make_task(
        "tool_arith", min_digits=1, max_digits=2, max_terms=2, max_turns=3, episode_tokens=160
    )  # configs/tiny-tools.yaml's task
    prompts = [encode_prompt(tok, ex.prompt) for ex in task.examples(8, seed=11)]
    params = SamplingParams(max_new_tokens=64, temperature=0.0)
    ours = EpisodeRunner(Engine(model, tok), task).generate(prompts, params)
    theirs = EpisodeRunner(backend, task, tok, max_context=backend.max_model_len).generate(
        prompts, params
    )
    assert sum(len(ep.tool_calls) for ep in theirs) >= len(prompts) // 2  # it uses the tool
    for a, b in zip(ours, theirs, strict=True):
        assert (b.response_ids, b.loss_mask, b.finish_reason) == (
            a.response_ids,
            a.loss_mask,
            a.finish_reason,
        )
        assert [c.output for c in b.tool_calls] == [c.output for c in a.tool_calls]
        assert b.logprobs == pytest.approx(a.logprobs, abs=LOGPROB_TOL)


def test_two_grpo_steps_on_a_vllm_server_train_on_policy(
    small_rl_config: RLConfig, server, prompt_texts, assert_serves_the_trained_policy
) -> None:
    from leantrain.rl.grpo import GRPORun

    cfg = small_rl_config.model_copy(update={"steps": 2, "checkpoint_every": 2}, deep=True)
    cfg.rollout = RolloutConfig(backend="vllm_server", vllm_urls=[server.url])
    run = GRPORun(cfg, progress=False)
    assert type(run.source.backend).__name__ == "VLLMServerBackend"
    summary = run.run()
    assert summary["steps"] == 2 and summary["policy_version"] == 2
    backend = run.source.backend
    assert backend.version == 2  # the last step's weights were published to the server
    assert [f.name for f in (cfg.out / "vllm-server-weights").iterdir()] == ["v2"]
    records = [json.loads(line) for line in (cfg.out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert r["weight_sync_s"] > 0 and r["weight_sync_s"] >= r["weight_publish_s"]
        assert math.isfinite(r["loss"]) and r["grad_norm"] > 0 and 0 <= r["reward"] <= 1
        # On-policy: the server sampled with the weights the trainer scores, so every token's
        # PPO ratio is 1 up to the logprob gap and none is clipped.
        assert r["ratio_mean"] == pytest.approx(1.0, abs=1e-3) and r["clip_fraction"] == 0
    print(f"GRPO on vllm serve, weight_sync_s per step: {[r['weight_sync_s'] for r in records]}")
    # After the run the server holds the trained weights: its greedy output is the trainer's.
    assert_serves_the_trained_policy(backend, run, prompt_texts, version=2)


def test_gpu_weight_transfers_are_set_up_only_where_they_can_run(
    small_rl_config: RLConfig, backend, server, tmp_path
) -> None:
    """`rollout.vllm_weight_transfer: nccl | ipc` (vLLM's engines; GPUs only, so the transfer
    itself runs in benchmarks/gpu_check.py, not here): the launch flag and environment the
    servers need, the refusals by field (not on CPU, not with LoRA, not off server mode; IPC
    only on 127.0.0.1), and a server started without the flag refused by name, read from its
    own settings."""
    from leantrain.generation import vllm_server
    from leantrain.generation.vllm_server import VLLMServerBackend, VLLMServerError

    for transfer in ("nccl", "ipc"):
        flag = ["--weight-transfer-config", f'{{"backend": "{transfer}"}}']
        cmd = vllm_server.server_command("m", port=1, weight_transfer=transfer)
        assert cmd[cmd.index(flag[0]) : cmd.index(flag[0]) + 2] == flag
        with pytest.raises(LeantrainError, match=rf"vllm_weight_transfer: {transfer} needs CUDA"):
            VLLMServerBackend([server.url], weights_dir=tmp_path, weight_transfer=transfer)
        # This server runs without the engine: its settings say so, and set-up refuses it.
        with pytest.raises(VLLMServerError, match=rf"without {transfer} .*backend is None"):
            backend._transfer_workers(server.url, transfer)
    assert "--weight-transfer-config" not in vllm_server.server_command("m", port=1)
    assert vllm_server.server_env(weight_transfer="ipc")["VLLM_ALLOW_INSECURE_SERIALIZATION"]
    assert "VLLM_ALLOW_INSECURE_SERIALIZATION" not in vllm_server.server_env()
    with pytest.raises(LeantrainError, match=r"ipc: the server unpickles .* 127\.0\.0\.1 only"):
        vllm_server.launch_server(tmp_path, host="0.0.0.0", weight_transfer="ipc")
    with pytest.raises(LeantrainError, match=r"vllm_weight_transfer: 'disk' is not one of"):
        VLLMServerBackend([server.url], weights_dir=tmp_path, weight_transfer="disk")
    with pytest.raises(LeantrainError, match=r"vllm_weight_transfer: nccl sends weights to"):
        RolloutConfig(vllm_weight_transfer="nccl")
    data = small_rl_config.model_dump()
    data["rollout"].update(
        backend="vllm_server", vllm_urls=[server.url], vllm_weight_transfer="nccl"
    )
    RLConfig(**data)
    data["lora"]["enabled"] = True
    with pytest.raises(LeantrainError, match=r"lora\.enabled with rollout\.vllm_weight_transfer"):
        RLConfig(**data)
    # The servers' workers reach the trainer's end of an NCCL group on the route to their host.
    assert vllm_server.address_towards(server.url) == "127.0.0.1"
