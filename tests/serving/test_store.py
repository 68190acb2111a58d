"""The SQLite store: WAL, evidence counts, eviction order, feedback once, and no partial or lost
entries when the writing process is killed mid-write."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from leantrain.errors import LeantrainError
from leantrain.serving.policy import Evidence
from leantrain.serving.store import CacheStore


def _vector(i: int) -> np.ndarray:
    return np.full(4, i, dtype=np.float32)


def test_entries_survive_reopening_in_wal_mode(tmp_path: Path) -> None:
    path = tmp_path / "c.sqlite"
    store = CacheStore(path)
    ids = [store.add(f"q{i}", f"a{i}", _vector(i), cost=i) for i in range(3)]
    store.close()
    store = CacheStore(path)
    assert store._db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert store.get(ids[1]).answer == "a1"
    got_ids, vectors = store.embeddings()
    assert got_ids.tolist() == ids and vectors[2].tolist() == [2.0] * 4


def test_evidence_counts_own_below_and_shared_in_the_window() -> None:
    store = CacheStore(":memory:")
    a, b = (store.add(q, "x", _vector(0), 1.0) for q in ("a", "b"))
    for entry, similarity, correct in [
        (a, 0.90, True), (a, 0.95, False), (a, 0.99, True),
        (b, 0.948, True), (b, 0.951, True), (b, 0.93, False),
    ]:  # fmt: skip
        store.observe(entry, similarity, correct)
    # a at 0.95: its own verdicts at <= 0.95, b's in [0.945, 0.95]
    assert store.evidence(a, 0.95, 0.005) == Evidence(1, 2, 1, 1)
    assert store.evidence(b, 1.0, 0.02) == Evidence(2, 3, 1, 1)


def test_feedback_is_recorded_once_and_a_hit_verdict_becomes_an_observation() -> None:
    store = CacheStore(":memory:")
    entry = store.add("q", "a", _vector(1), 1.0)
    hit = store.record_served(entry, 0.97, "hit")
    miss = store.record_served(None, None, "miss")
    assert store.set_feedback(hit, False) and not store.set_feedback(hit, True)
    assert store.set_feedback(miss, True)
    assert store.served(hit).feedback is False
    assert store.evidence(entry, 1.0, 0.0) == Evidence(0, 1, 0, 0)  # only the hit's verdict


def test_eviction_orders_by_recency_or_by_saved_cost() -> None:
    store = CacheStore(":memory:")
    cheap, dear, used = (
        store.add(q, "a", _vector(0), c) for q, c in (("c", 1), ("d", 9), ("u", 2))
    )
    store.record_hit(used)
    store.record_hit(cheap)  # now the most recently used
    assert store.eviction_order("lru", 1) == [dear]
    assert store.eviction_order("cost", 2) == [cheap, used]  # (1+1)*1 < (1+1)*2 < 1*9
    store.delete([cheap])
    assert store.count() == 2 and store.get(cheap) is None
    with pytest.raises(LeantrainError, match="eviction"):
        store.eviction_order("random", 1)


def test_a_killed_writer_loses_no_committed_entry_and_leaves_no_partial_one(
    tmp_path: Path,
) -> None:
    path = tmp_path / "c.sqlite"
    writer = textwrap.dedent(f"""
        import numpy as np, sys
        from leantrain.serving.store import CacheStore
        store = CacheStore({str(path)!r})
        for i in range(100000):
            entry = store.add(f"q{{i}}", "a" * 2000, np.ones(384, np.float32), 1.0)
            store.observe(entry, 0.9, True)
            print(entry, flush=True)
    """)
    process = subprocess.Popen([sys.executable, "-c", writer], stdout=subprocess.PIPE, text=True)
    committed = [int(process.stdout.readline()) for _ in range(200)]
    process.kill()  # SIGKILL: no cleanup, possibly mid-transaction
    process.wait()
    store = CacheStore(path)
    assert store._db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    assert all(store.get(i) is not None for i in committed)
    ids, vectors = store.embeddings()
    assert vectors.shape == (len(ids), 384)  # every stored entry is whole
    assert len(ids) >= len(committed)
