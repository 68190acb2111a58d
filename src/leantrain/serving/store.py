"""The semantic cache's durable state in one SQLite file: cached answers with their embeddings,
per-entry statistics, every served answer (so feedback can find it) and the observations
(similarity, was the cached answer right) that the verified policy learns from, and the state of
a policy that keeps one (the budgeted policy's budget), as text.

SQLite in WAL mode: readers never block the writer, and every write below is one transaction, so
a process killed mid-write leaves either the whole entry or none of it (WAL with
`synchronous=NORMAL` survives an application crash; only a power loss can drop the latest
commits). One connection, shared by threads under a lock: the cache's writes are small and
serialised anyway, and a single connection keeps transactions simple.

Knows nothing about embedding models, vector search or how a policy decides: embeddings are
float32 blobs, and evidence goes out as counts.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from leantrain.errors import LeantrainError
from leantrain.serving.policy import Evidence

# float32 inner products of unit vectors wobble by ~1e-7: an identical request may score
# 0.9999999 one time and 1.0000001 the next, and must count as the same similarity.
_FLOAT_SLACK = 1e-6

_SCHEMA = """
CREATE TABLE IF NOT EXISTS entries (
    id INTEGER PRIMARY KEY,
    prompt TEXT NOT NULL,
    answer TEXT NOT NULL,
    embedding BLOB NOT NULL,
    cost REAL NOT NULL,
    created REAL NOT NULL,
    last_used REAL NOT NULL,
    hits INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS observations (
    entry_id INTEGER NOT NULL REFERENCES entries(id) ON DELETE CASCADE,
    similarity REAL NOT NULL,
    correct INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS observations_entry ON observations(entry_id, similarity);
CREATE INDEX IF NOT EXISTS observations_similarity ON observations(similarity);
CREATE TABLE IF NOT EXISTS policy_state (
    name TEXT PRIMARY KEY,
    state TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS served (
    id INTEGER PRIMARY KEY,
    entry_id INTEGER,
    similarity REAL,
    source TEXT NOT NULL,
    at REAL NOT NULL,
    feedback INTEGER
);
"""


@dataclass(frozen=True)
class Entry:
    """One cached answer."""

    id: int
    prompt: str
    answer: str
    cost: float
    hits: int


@dataclass(frozen=True)
class Served:
    """One answer given to a client: from `source` "hit", "miss" or "explore"."""

    id: int
    entry_id: int | None
    similarity: float | None
    source: str
    feedback: bool | None


class CacheStore:
    """SQLite-backed entries, observations and served answers (see the module doc).

    Args:
        path: the database file (created with its folder); ":memory:" for a throwaway store.
    """

    def __init__(self, path: str | Path) -> None:
        if str(path) != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        try:
            self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.execute("PRAGMA foreign_keys=ON")
            self._db.executescript(_SCHEMA)
        except sqlite3.DatabaseError as e:
            raise LeantrainError(f"cache database {path}: {e}") from None
        self._lock = threading.RLock()

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        """One atomic write: all of it is committed, or (on any error or crash) none of it."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def add(self, prompt: str, answer: str, embedding: np.ndarray, cost: float) -> int:
        """Store a new entry; returns its id."""
        now = time.time()
        blob = np.asarray(embedding, dtype=np.float32).tobytes()
        with self._transaction() as db:
            cur = db.execute(
                "INSERT INTO entries (prompt, answer, embedding, cost, created, last_used) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                (prompt, answer, blob, float(cost), now, now),
            )
            return int(cur.lastrowid)

    def get(self, entry_id: int) -> Entry | None:
        with self._lock:
            row = self._db.execute(
                "SELECT id, prompt, answer, cost, hits FROM entries WHERE id = ?", (entry_id,)
            ).fetchone()
        return Entry(*row) if row else None

    def embeddings(self) -> tuple[np.ndarray, np.ndarray]:
        """(ids (n,) int64, embeddings (n, dim) float32) of every entry, to rebuild an index."""
        with self._lock:
            rows = self._db.execute("SELECT id, embedding FROM entries ORDER BY id").fetchall()
        if not rows:
            return np.zeros(0, np.int64), np.zeros((0, 0), np.float32)
        ids = np.array([r[0] for r in rows], dtype=np.int64)
        return ids, np.stack([np.frombuffer(r[1], dtype=np.float32) for r in rows])

    def count(self) -> int:
        with self._lock:
            return int(self._db.execute("SELECT COUNT(*) FROM entries").fetchone()[0])

    def record_hit(self, entry_id: int) -> None:
        """Count a hit and mark the entry as just used (LRU)."""
        with self._transaction() as db:
            db.execute(
                "UPDATE entries SET hits = hits + 1, last_used = ? WHERE id = ?",
                (time.time(), entry_id),
            )

    def observe(self, entry_id: int, similarity: float, correct: bool) -> None:
        """Record that serving this entry at `similarity` was right or wrong."""
        with self._transaction() as db:
            db.execute(
                "INSERT INTO observations (entry_id, similarity, correct) "
                "SELECT id, ?, ? FROM entries WHERE id = ?",  # a no-op if it was evicted
                (float(similarity), int(correct), entry_id),
            )

    def evidence(self, entry_id: int, similarity: float, window: float) -> Evidence:
        """Verdicts on `entry_id` at similarities <= `similarity`, and on other entries in
        [similarity - window, similarity] (see `Evidence`)."""
        top = similarity + _FLOAT_SLACK
        with self._lock:
            own = self._db.execute(
                "SELECT COALESCE(SUM(correct), 0), COUNT(*) FROM observations "
                "WHERE entry_id = ? AND similarity <= ?",
                (entry_id, top),
            ).fetchone()
            shared = self._db.execute(
                "SELECT COALESCE(SUM(correct), 0), COUNT(*) FROM observations "
                "WHERE similarity BETWEEN ? AND ? AND entry_id != ?",
                (similarity - window - _FLOAT_SLACK, top, entry_id),
            ).fetchone()
        return Evidence(*own, *shared)

    def record_served(self, entry_id: int | None, similarity: float | None, source: str) -> int:
        """Log one answer given to a client; returns the id clients send feedback about."""
        with self._transaction() as db:
            cur = db.execute(
                "INSERT INTO served (entry_id, similarity, source, at) VALUES (?, ?, ?, ?)",
                (entry_id, similarity, source, time.time()),
            )
            return int(cur.lastrowid)

    def served(self, served_id: int) -> Served | None:
        with self._lock:
            row = self._db.execute(
                "SELECT id, entry_id, similarity, source, feedback FROM served WHERE id = ?",
                (served_id,),
            ).fetchone()
        if row is None:
            return None
        return Served(*row[:4], None if row[4] is None else bool(row[4]))

    def set_feedback(self, served_id: int, correct: bool) -> bool:
        """Attach feedback to a served answer once; True if this call set it. For a cache hit
        the verdict is also an observation of its entry, in the same transaction."""
        with self._transaction() as db:
            cur = db.execute(
                "UPDATE served SET feedback = ? WHERE id = ? AND feedback IS NULL",
                (int(correct), served_id),
            )
            if cur.rowcount == 0:
                return False
            db.execute(
                "INSERT INTO observations (entry_id, similarity, correct) "
                "SELECT e.id, s.similarity, ? FROM served s JOIN entries e ON e.id = s.entry_id "
                "WHERE s.id = ? AND s.source = 'hit'",
                (int(correct), served_id),
            )
            return True

    def eviction_order(self, policy: str, count: int) -> list[int]:
        """The `count` entries to evict first: "lru" by last use; "cost" by the backend cost
        each saves, (1 + hits) x cost (cheap, never-reused answers go first), then by last use."""
        order = {"lru": "last_used", "cost": "(1 + hits) * cost, last_used"}
        if policy not in order:
            raise LeantrainError(f"eviction must be one of {sorted(order)}, got {policy!r}")
        with self._lock:
            rows = self._db.execute(
                f"SELECT id FROM entries ORDER BY {order[policy]} LIMIT ?", (count,)
            ).fetchall()
        return [r[0] for r in rows]

    def delete(self, entry_ids: list[int]) -> None:
        """Remove entries and their observations."""
        with self._transaction() as db:
            db.executemany("DELETE FROM entries WHERE id = ?", [(i,) for i in entry_ids])

    def save_policy_state(self, name: str, state: str) -> None:
        """Keep `state` (text) as the policy `name`'s, replacing what was kept before."""
        with self._transaction() as db:
            db.execute(
                "INSERT INTO policy_state (name, state) VALUES (?, ?) "
                "ON CONFLICT(name) DO UPDATE SET state = excluded.state",
                (name, state),
            )

    def policy_state(self, name: str) -> str | None:
        """The state last kept for the policy `name`, or None."""
        with self._lock:
            row = self._db.execute(
                "SELECT state FROM policy_state WHERE name = ?", (name,)
            ).fetchone()
        return row[0] if row else None

    def close(self) -> None:
        with self._lock:
            self._db.close()
