"""The learner model against a step computed by hand, its invariants, and its refusals."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from leantrain.errors import LeantrainError
from leantrain.rl.learner_sim import (
    GPUS,
    MODELS,
    Accelerator,
    LearnerSetup,
    ModelShape,
    accelerator,
    model_shape,
    predict_learner,
)
from leantrain.rl.simulate import lognormal_lengths, plan

# N = 1e9, L = 10, h = 1000, H = 10, Hkv = 2, V = 1000; 1 PFLOP/s, NVLink 100 GB/s, network 10.
MODEL = ModelShape(params=1e9, layers=10, hidden=1000, heads=10, kv_heads=2, vocab=1000)
GPU = Accelerator("test", peak_flops=1e15, memory_gb=80, intra_gbps=100, inter_gbps=10)
# W = 8, P = 2: 4 Ulysses groups of 400k tokens each, 4 micro-batches of 100k per group.
SETUP = LearnerSetup(
    MODEL,
    GPU,
    gpus=8,
    tokens=1.6e6,
    seq_len=1000,
    micro_tokens=100_000,
    sequence_parallel=2,
    mfu=0.5,
    recompute=True,
)


def test_a_step_computed_by_hand():
    """compute: (3 + 1) * 2 * (1e9 + 10 * 1000 * 1000) * 1.6e6 = 1.2928e16 FLOPs over
    8 x 1e15 x 0.5 FLOP/s = 3.232 s.
    FSDP: 7/8 * (2 all-gathers x 2 bytes x 1e9 x 4 micro-batches + 4 bytes x 1e9) = 1.75e10
    bytes at 100 GB/s = 0.175 s, all hidden behind compute.
    Ulysses: per layer (2 * 1000 + 2 * 200) widths x 2 bytes x 1/2 sent x 200k tokens = 4.8e8
    bytes; x 10 layers x 3 passes (forward, backward, recompute) = 1.44e10 bytes = 0.144 s.
    sync: 7/8 * 2e9 bytes at 100 GB/s + 2e9 at 10 GB/s = 0.2175 s.
    memory: states 16e9 / 8 = 2.0 GB; two layers' bf16 weights 2 * 2e9 / 10 = 0.4 GB;
    50k tokens per GPU: activations (2 * 1000 * 10 + 34 * 1000) * 5e4 = 2.7 GB, logits
    4 * 1000 * 5e4 = 0.2 GB; 5.3 GB in all."""
    p = predict_learner(SETUP)
    assert p.flops == pytest.approx(1.2928e16)
    assert p.compute_s == pytest.approx(3.232)
    assert p.micro_batches == 4
    assert p.fsdp_bytes == pytest.approx(1.75e10)
    assert p.fsdp_s == pytest.approx(0.175)
    assert p.exposed_fsdp_s == pytest.approx(0.0)
    assert p.sp_bytes == pytest.approx(1.44e10)
    assert p.sp_s == pytest.approx(0.144)
    assert p.train_s == pytest.approx(3.232 + 0.144)
    assert p.sync_s == pytest.approx(0.2175)
    assert p.step_s == pytest.approx(3.376 + 0.2175)
    expected = {"states": 2.0, "gathered weights": 0.4, "activations": 2.7, "logits": 0.2}
    for part, gb in expected.items():
        assert p.memory_gb[part] == pytest.approx(gb)
    assert p.memory_gb["total"] == pytest.approx(5.3)


def test_no_overlap_adds_the_fsdp_traffic_in_full():
    p = predict_learner(replace(SETUP, overlap=0.0))
    assert p.exposed_fsdp_s == pytest.approx(0.175)
    assert p.train_s == pytest.approx(3.232 + 0.175 + 0.144)


def test_kv_heads_that_p_does_not_divide_travel_repeated_to_full_width():
    """H = 8, Hkv = 2, P = 4: k and v go at h = 1000 wide, so 4 * 1000 * 2 bytes * 3/4 * 200k
    tokens per layer, x 10 layers x 2 passes (no recompute) = 2.4e10 bytes."""
    model = replace(MODEL, heads=8)
    p = predict_learner(replace(SETUP, model=model, sequence_parallel=4, recompute=False))
    assert p.sp_bytes == pytest.approx(2.4e10)


def test_more_gpus_less_compute_and_less_state_per_gpu():
    runs = [predict_learner(replace(SETUP, gpus=w)) for w in (2, 4, 8, 16, 32)]
    compute = [p.compute_s for p in runs]
    states = [p.memory_gb["states"] for p in runs]
    assert all(np.diff(compute) < 0) and all(np.diff(states) < 0)
    assert compute[0] / compute[-1] == pytest.approx(16)  # compute is exactly 1/W


def test_sequence_parallel_cuts_activation_memory_and_costs_traffic():
    model = replace(MODEL, heads=8, kv_heads=4)
    runs = [predict_learner(replace(SETUP, model=model, sequence_parallel=p)) for p in (1, 2, 4)]
    acts = [p.memory_gb["activations"] + p.memory_gb["logits"] for p in runs]
    assert all(np.diff(acts) < 0)
    assert acts[0] / acts[2] == pytest.approx(4)
    assert runs[0].sp_s == 0.0 and 0 < runs[1].sp_s < runs[2].sp_s


def test_recompute_trades_a_forward_for_activation_memory():
    on, off = predict_learner(SETUP), predict_learner(replace(SETUP, recompute=False))
    assert on.compute_s / off.compute_s == pytest.approx(4 / 3)
    assert on.memory_gb["activations"] < off.memory_gb["activations"]


def test_faster_links_move_the_same_bytes_sooner():
    fast = replace(GPU, intra_gbps=400)
    slow, quick = predict_learner(SETUP), predict_learner(replace(SETUP, gpu=fast))
    assert quick.fsdp_bytes == slow.fsdp_bytes and quick.fsdp_s == pytest.approx(slow.fsdp_s / 4)


def test_fsdp_across_nodes_runs_at_the_network_rate():
    p8, p16 = predict_learner(SETUP), predict_learner(replace(SETUP, gpus=16))
    assert p8.fsdp_s == pytest.approx(p8.fsdp_bytes / 100e9)
    assert p16.fsdp_s == pytest.approx(p16.fsdp_bytes / 10e9)


def test_presets_are_chosen_by_name_and_overridable():
    h200 = accelerator("H200")
    assert h200 == GPUS["h200"] and h200.memory_gb > GPUS["h100"].memory_gb
    custom = accelerator("h100", memory_gb=96, gpus_per_node=4)
    assert custom.memory_gb == 96 and custom.peak_flops == GPUS["h100"].peak_flops
    assert model_shape("qwen2.5-7b", params_b=7.0).params == 7e9
    assert model_shape("llama3-70b") == MODELS["llama3-70b"]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"gpus": 0}, "gpus must be >= 1"),
        ({"tokens": 0}, "tokens"),
        ({"sequence_parallel": 3}, r"sequence_parallel \(3\) must be >= 1 and divide gpus"),
        ({"gpus": 12, "sequence_parallel": 4}, r"does not divide the model's 10 attention heads"),
        ({"mfu": 0.0}, r"mfu must be in \(0, 1\]"),
        ({"mfu": 1.5}, "mfu"),
        ({"overlap": 2.0}, "overlap"),
        ({"micro_tokens": 500}, "micro_tokens"),
        ({"sync_gbps": 0.0}, "sync_gbps"),
    ],
)
def test_bad_settings_are_refused_by_name(change, message):
    with pytest.raises(LeantrainError, match=message):
        replace(SETUP, **change)


def test_bad_hardware_and_models_are_refused_by_name():
    with pytest.raises(LeantrainError, match="unknown gpu 'v100'; presets: a100, h100, h200"):
        accelerator("v100")
    with pytest.raises(LeantrainError, match="unknown model"):
        model_shape("gpt-5")
    with pytest.raises(LeantrainError, match=r"kv_heads \(3\) must divide heads \(10\)"):
        replace(MODEL, kv_heads=3)
    with pytest.raises(LeantrainError, match="peak_flops must be > 0"):
        replace(GPU, peak_flops=0)


def test_a_model_that_does_not_fit_names_what_to_change():
    """70B on 8 A100s without recompute: 16 * 70.6e9 / 8 = 141 GB of state alone."""
    setup = LearnerSetup(MODELS["llama3-70b"], GPUS["a100"], 8, 1e6, 4096, recompute=False)
    with pytest.raises(LeantrainError, match="does not fit") as e:
        predict_learner(setup)
    for setting in ("raise gpus", "sequence_parallel", "recompute", "micro_tokens"):
        assert setting in str(e.value)


def test_plan_takes_training_and_sync_from_the_learner():
    """With the learner, a sync step is at least the rollout plus its predicted train + sync."""
    lengths = lognormal_lengths(100, 400, 2000)
    setup = LearnerSetup(MODELS["qwen2.5-0.5b"], GPUS["h100"], 1, 1.0, 2000, mfu=0.01)
    rows = plan([8], sequences=256, lengths=lengths, steps=3, slots=32, learner=setup)
    trained = predict_learner(replace(setup, gpus=8, tokens=256 * float(np.mean(lengths))))
    sync = next(r for r in rows if r.setup == "sync")
    assert sync.step_s >= trained.step_s
    guessed = plan([8], sequences=256, lengths=lengths, steps=3, slots=32)
    assert sync.step_s != next(r for r in guessed if r.setup == "sync").step_s
