"""The cluster model against hand-computed timelines, and calibration recovering known costs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from leantrain.errors import LeantrainError
from leantrain.rl.simulate import Cluster, Workload, calibrate, lognormal_lengths, plan, simulate

# Every response 3 tokens, 2 per step; an iteration with 2 live sequences costs 1 + 0.5 * 2 = 2 s,
# so a batch takes 3 * 2 = 6 s to generate; training takes 4 s.
CLUSTER = Cluster(rollout_workers=1, slots=2, iteration_s=1.0, sequence_s=0.5, train_s=4.0)
WORK = Workload(steps=3, sequences=2, lengths=(3,))


def test_sync_is_generate_then_train_every_step():
    p = simulate(CLUSTER, WORK, max_staleness=0)
    assert p.seconds == pytest.approx(3 * (6 + 4))
    assert p.generation_idle == pytest.approx(1 - 18 / 30)


def test_async_k1_overlaps_generation_with_training():
    """gen b0 0-6 | gen b1 6-12 (k=1 lets it start on v0) | train s0 6-10 | gen b2 needs v1
    (t=10), worker free at 12: 12-18 | train s1 12-16 | train s2 18-22."""
    p = simulate(CLUSTER, WORK, max_staleness=1)
    assert p.seconds == pytest.approx(22.0)
    assert p.trainer_idle == pytest.approx((6 + 2 + 2) / 22)


def test_continuous_batching_costs_a_times_longest_plus_c_times_tokens():
    """Lengths 2 and 4 in one batch: 2 iterations at 2 live (2 s each), 2 at 1 live (1.5 s):
    7 s = a * L + c * T = 1 * 4 + 0.5 * 6."""
    cluster = Cluster(slots=2, iteration_s=1.0, sequence_s=0.5, train_s=0.0)
    work = Workload(steps=1, sequences=2, lengths=(2, 4), seed=3)
    p = simulate(cluster, work, max_staleness=0)
    # Draws are with replacement: recompute the hand formula for what was drawn.
    drawn = np.random.default_rng(3).choice(np.array([2.0, 4.0]), 2)
    assert p.seconds == pytest.approx(1.0 * drawn.max() + 0.5 * drawn.sum())


def test_speculative_decoding_in_the_tail_shortens_it():
    """One 10-token sequence alone: plain 10 iterations of 1.5 s = 15 s; speculative at
    2.5 tokens per iteration and 1.2x cost: 10 / 2.5 * 1.8 = 7.2 s."""
    plain = Cluster(slots=4, iteration_s=1.0, sequence_s=0.5, train_s=0.0)
    spec = Cluster(
        slots=4,
        iteration_s=1.0,
        sequence_s=0.5,
        train_s=0.0,
        spec_threshold=1,
        spec_tokens=2.5,
        spec_cost=1.2,
    )
    work = Workload(steps=1, sequences=1, lengths=(10,))
    assert simulate(plain, work, 0).seconds == pytest.approx(15.0)
    assert simulate(spec, work, 0).seconds == pytest.approx(7.2)


def test_streaming_beats_batch_granularity_when_batches_have_tails():
    lengths = lognormal_lengths(20, 80, 400, n=512)
    cluster = Cluster(slots=64, iteration_s=0.01, sequence_s=0.0001, train_s=0.5)
    work = Workload(steps=6, sequences=64, lengths=lengths)
    sync = simulate(cluster, work, 0)
    batch = simulate(cluster, work, 2, granularity="batch")
    stream = simulate(cluster, work, 2, granularity="sequence")
    assert stream.seconds < batch.seconds < sync.seconds


def test_calibrate_recovers_known_costs(tmp_path: Path):
    a, c = 0.004, 0.0003
    steps = [[5, 9, 40], [7, 7, 12], [30, 3, 4], [11, 60, 2]]
    with (tmp_path / "metrics.jsonl").open("w") as f:
        for i, lengths in enumerate(steps):
            gen = a * max(lengths) + c * sum(lengths)
            record = {
                "step": i + 1,
                "generate_s": gen,
                "train_s": 1.0 + i,
                "response_lengths": lengths,
            }
            f.write(json.dumps(record) + "\n")
    cal = calibrate(tmp_path, slots=8)
    assert cal.cluster.iteration_s == pytest.approx(a, rel=1e-6)
    assert cal.cluster.sequence_s == pytest.approx(c, rel=1e-6)
    assert cal.cluster.train_s == pytest.approx(2.5)  # median of 1, 2, 3, 4
    assert cal.fit_error < 1e-6
    assert cal.workload.sequences == 3 and sorted(cal.workload.lengths)[-1] == 60


def test_calibrate_needs_a_run_folder(tmp_path: Path):
    with pytest.raises(LeantrainError, match=r"no metrics\.jsonl"):
        calibrate(tmp_path)


def test_plan_predicts_async_gains_that_grow_with_k():
    rows = plan([8], sequences=256, lengths=lognormal_lengths(100, 400, 2000), steps=4, slots=32)
    speedup = {r.setup: r.speedup for r in rows}
    assert speedup["sync"] == 1.0
    assert 1.0 < speedup["async k=1"] < speedup["async k=2"]
