"""The meeting point of async RL: batches exactly once and oldest first, a bounded number
outstanding, weight versions kept k + 1 deep, and every wait ending in a clear error."""

from __future__ import annotations

import threading
import time

import pytest

from leantrain.errors import LeantrainError
from leantrain.rl.buffer import BatchBuffer, RolloutBatch, StallError, WeightStore


def _batch(index: int) -> RolloutBatch:
    return RolloutBatch(index=index, trajectories=[], version=0, worker="w")


def test_batches_come_out_oldest_first_even_when_they_arrive_out_of_order() -> None:
    buffer = BatchBuffer(capacity=3)
    for index in (2, 0, 1):
        assert buffer.put(_batch(index))
    assert [buffer.get(timeout=1).index for _ in range(3)] == [0, 1, 2]


def test_a_batch_is_delivered_exactly_once() -> None:
    buffer = BatchBuffer(capacity=2)
    assert buffer.put(_batch(0)) and not buffer.put(_batch(0))  # held twice
    buffer.get(timeout=1)
    assert not buffer.put(_batch(0))  # already trained
    assert buffer.duplicates == 2 and len(buffer) == 0


def test_more_outstanding_batches_than_the_bound_is_an_error() -> None:
    buffer = BatchBuffer(capacity=2, next_index=5)
    buffer.put(_batch(6))
    with pytest.raises(LeantrainError, match="more than 2 batches outstanding"):
        buffer.put(_batch(7))


def test_get_waits_for_the_oldest_and_times_out_with_a_description() -> None:
    buffer = BatchBuffer(capacity=2)
    buffer.put(_batch(1))  # batch 0 is missing: 1 must not be handed out first
    start = time.monotonic()
    with pytest.raises(StallError, match=r"rollout batch 0 .*worker 3 is stuck"):
        buffer.get(timeout=0.3, describe=lambda: "worker 3 is stuck")
    assert 0.3 <= time.monotonic() - start < 2.0


def test_get_raises_the_check_error_at_once() -> None:
    buffer = BatchBuffer(capacity=1)

    def dead() -> None:
        raise LeantrainError("dispatcher died")

    start = time.monotonic()
    with pytest.raises(LeantrainError, match="dispatcher died"):
        buffer.get(timeout=30, check=dead)
    assert time.monotonic() - start < 1.0


def test_get_wakes_when_the_batch_arrives_from_another_thread() -> None:
    buffer = BatchBuffer(capacity=1)
    threading.Timer(0.1, buffer.put, args=(_batch(0),)).start()
    assert buffer.get(timeout=5).index == 0


def test_weight_store_keeps_the_newest_k_plus_one_versions() -> None:
    store = WeightStore(keep=2)
    assert store.newest() is None
    for step in range(4):
        store.publish(step, version=10 * step, payload=f"w{step}")
    assert store.held() == [20, 30]
    assert store.newest().payload == "w3"
    with pytest.raises(ValueError, match="steps must increase"):
        store.publish(3, version=40, payload="again")


def test_weight_store_wait_for_step() -> None:
    store = WeightStore(keep=1)
    store.publish(0, 0, "w0")
    assert store.wait_for_step(1, timeout=0.1) is None  # times out, no exception
    threading.Timer(0.1, store.publish, args=(1, 1, "w1")).start()
    assert store.wait_for_step(1, timeout=5).payload == "w1"
