"""The semantic cache: embed a request, find the nearest cached entry (faiss, inner product on
unit vectors = cosine), let the hit policy decide, and otherwise ask the backend.

On a miss the backend's answer is compared with the nearest entry's (`answers_match`) and that
verdict becomes an observation of the entry: the verified policy learns from it. A miss becomes a
new entry unless the nearest entry is the same request and was right (vCache adds one only when
the nearest was wrong; storing new phrasings too lets their repeats match at similarity 1, where
the evidence is strongest). Feedback on a served hit (`feedback`) is an observation as well. The
size bound evicts by `lru` or `cost` (see `CacheStore.eviction_order`).

`calibration_verdicts` replays a labelled stream through a throwaway cache that never serves, to
collect the verdicts that warm-start a `VerifiedPolicy` (see `leantrain.serving.policy`).

SQLite (`CacheStore`) is the truth; the faiss index is rebuilt from it on open and a stateful
policy's state is kept in it, so a restart loses nothing. Thread-safe: lookups and writes hold a
lock, the backend call does not.

Knows nothing about HTTP or models: the backend is any `prompt -> (answer, cost)` callable.
"""

from __future__ import annotations

import json
import logging
import random
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import faiss
import numpy as np

from leantrain.errors import LeantrainError
from leantrain.serving.embedding import Embedder
from leantrain.serving.policy import (
    Decision,
    Evidence,
    ExplorePolicy,
    HitPolicy,
    StatefulPolicy,
    Verdicts,
)
from leantrain.serving.store import CacheStore

log = logging.getLogger(__name__)

Backend = Callable[[str], tuple[str, float]]  # prompt -> (answer, cost of producing it)
Source = Literal["hit", "miss"]
SAME_REQUEST = 1e-5  # similarity within this of 1: the same text (float32 rounding aside)


def normalised_match(cached: str, fresh: str) -> bool:
    """Answers match when equal up to case and whitespace (the evaluator is pluggable: an
    embedding match or an LLM judge fit sampled answers better)."""
    return " ".join(cached.casefold().split()) == " ".join(fresh.casefold().split())


@dataclass(frozen=True)
class CacheResult:
    """One answered request. `entry_id`/`similarity`: the nearest entry (None if the cache was
    empty); `served_id`: what feedback refers to."""

    answer: str
    source: Source
    served_id: int
    entry_id: int | None
    similarity: float | None
    decision: Decision | None


@dataclass
class CacheCounters:
    """Running totals since this process opened the cache (for /metrics)."""

    requests: int = 0
    hits: int = 0
    misses: int = 0
    explorations: int = 0  # misses that compared the backend's answer with a cached one
    expected_wrong_hits: float = 0.0  # sum over hits of 1 - predicted P(correct)
    feedback: dict[bool, int] = field(default_factory=lambda: {True: 0, False: 0})


class SemanticCache:
    """A semantic cache over a SQLite file (see the module doc).

    Args:
        path: SQLite file of the cache (":memory:" for a throwaway one).
        embedder: texts -> unit-norm float32 rows.
        policy: `ThresholdPolicy`, `VerifiedPolicy` or `BudgetedPolicy` (which keeps state:
            one per cache; its state is kept in the file after every decision and restored
            when the file is opened again with the same settings).
        max_entries: size bound; the eviction policy makes room beyond it.
        eviction: "lru" or "cost".
        answers_match: judges whether a cached answer is right for a request, given the
            backend's fresh answer.
        seed: seeds the policy's exploration draws.
    """

    def __init__(
        self,
        path: str | Path,
        embedder: Embedder,
        policy: HitPolicy,
        *,
        max_entries: int = 10_000,
        eviction: str = "lru",
        answers_match: Callable[[str, str], bool] = normalised_match,
        seed: int | None = None,
    ) -> None:
        if max_entries < 1:
            raise LeantrainError(f"max_entries must be >= 1, got {max_entries}")
        self.store = CacheStore(path)
        self.store.eviction_order(eviction, 0)  # validates the name now, not at the first eviction
        self.embedder = embedder
        self.policy = policy
        self.max_entries = max_entries
        self.eviction = eviction
        self.answers_match = answers_match
        self.counters = CacheCounters()
        self._rng = random.Random(seed)
        self._lock = threading.RLock()
        self._index = faiss.IndexIDMap2(faiss.IndexFlatIP(embedder.dim))
        ids, vectors = self.store.embeddings()
        if len(ids):
            if vectors.shape[1] != embedder.dim:
                raise LeantrainError(
                    f"cache {path} holds {vectors.shape[1]}-dim embeddings but the embedder "
                    f"makes {embedder.dim}-dim ones: use the embedder it was built with"
                )
            self._index.add_with_ids(vectors, ids)
        if isinstance(policy, StatefulPolicy):
            kept = self.store.policy_state(policy.name)
            if kept is not None and not policy.restore(json.loads(kept)):
                log.warning(
                    "cache %s: the kept %s state was spent under other settings; starting fresh",
                    path,
                    policy.name,
                )

    def __len__(self) -> int:
        return self.store.count()

    def query(self, prompt: str, backend: Backend) -> CacheResult:
        """Answer `prompt` from the cache or from `backend` (see the module doc)."""
        vector = self.embedder([prompt])  # (1, dim)
        with self._lock:
            self.counters.requests += 1
            entry_id, similarity = self._nearest(vector)
            decision = None
            if entry_id is not None:
                evidence = Evidence()
                if self.policy.window is not None:
                    evidence = self.store.evidence(entry_id, similarity, self.policy.window)
                decision = self.policy.decide(similarity, evidence, self._rng)
                if isinstance(self.policy, StatefulPolicy):
                    state = json.dumps(self.policy.state())
                    self.store.save_policy_state(self.policy.name, state)
                entry = self.store.get(entry_id)
                if decision.hit and entry is not None:
                    self.counters.hits += 1
                    if decision.predicted_correct is not None:
                        self.counters.expected_wrong_hits += 1 - decision.predicted_correct
                    self.store.record_hit(entry_id)
                    served = self.store.record_served(entry_id, similarity, "hit")
                    return CacheResult(entry.answer, "hit", served, entry_id, similarity, decision)
        answer, cost = backend(prompt)  # slow: outside the lock
        with self._lock:
            self.counters.misses += 1
            matched = False
            entry = self.store.get(entry_id) if entry_id is not None else None
            if entry is not None:  # None also when it was evicted meanwhile
                self.counters.explorations += 1
                matched = self.answers_match(entry.answer, answer)
                self.store.observe(entry_id, similarity, matched)
            if not (matched and similarity >= 1 - SAME_REQUEST):
                self._insert(prompt, answer, vector, cost)
            served = self.store.record_served(entry_id, similarity, "miss")
        return CacheResult(answer, "miss", served, entry_id, similarity, decision)

    def feedback(self, served_id: int, correct: bool) -> None:
        """Record whether the answer given as `served_id` was right (once per answer)."""
        with self._lock:
            if self.store.served(served_id) is None:
                raise LeantrainError(f"no served answer with id {served_id}")
            if not self.store.set_feedback(served_id, correct):
                raise LeantrainError(f"served answer {served_id} already has feedback")
            self.counters.feedback[bool(correct)] += 1

    def _nearest(self, vector: np.ndarray) -> tuple[int | None, float | None]:
        if self._index.ntotal == 0:
            return None, None
        similarities, ids = self._index.search(vector, 1)
        return int(ids[0, 0]), float(similarities[0, 0])

    def _insert(self, prompt: str, answer: str, vector: np.ndarray, cost: float) -> None:
        entry_id = self.store.add(prompt, answer, vector[0], cost)
        self._index.add_with_ids(vector, np.array([entry_id], dtype=np.int64))
        excess = self.store.count() - self.max_entries
        if excess > 0:
            victims = self.store.eviction_order(self.eviction, excess)
            self.store.delete(victims)
            self._index.remove_ids(np.array(victims, dtype=np.int64))

    def close(self) -> None:
        self.store.close()


def calibration_verdicts(
    labelled: Sequence[tuple[str, str]],
    embedder: Embedder,
    answers_match: Callable[[str, str], bool] = normalised_match,
) -> Verdicts:
    """Replay (request, right answer) pairs through a fresh in-memory cache that always asks the
    backend (the labels stand in for it) and return every verdict it saw: the similarity of each
    request to its nearest entry and whether that entry's answer was right for it. The cache grows
    as a live one would (same insertion rule), so the similarities are those a live cache meets."""
    truth = dict(labelled)
    if len(truth) != len({(request, answer) for request, answer in labelled}):
        raise LeantrainError("calibration stream: one request has two different answers")
    cache = SemanticCache(":memory:", embedder, ExplorePolicy(), max_entries=len(labelled) + 1)
    similarities, correct = [], []
    for request, answer in labelled:
        result = cache.query(request, lambda prompt: (truth[prompt], 0.0))
        if result.entry_id is not None:
            nearest = cache.store.get(result.entry_id)
            similarities.append(result.similarity)
            correct.append(answers_match(nearest.answer, answer))
    cache.close()
    return Verdicts(np.array(similarities), np.array(correct, dtype=bool))
